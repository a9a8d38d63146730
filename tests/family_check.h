/* family_check.h — test support: the checks the decoder-family tests (mistral, mixtral, qwen3,
 * qwen3_moe) share, each test keeping its own cases and expected values: the loss against real
 * MaxText 0.2.5 (tests/data/maxtext-0.2.5/losses), the sharding dump against MaxText's, the parity of
 * every mesh with one device, and the refusals naming the key.  Failures end the test (cmocka). */
#ifndef TESTS_FAMILY_CHECK_H
#define TESTS_FAMILY_CHECK_H

#include <stdint.h>

#include "config/json.h"
#include "models/core/model.h"

/* One loss measurement (losses/<name>.json, made by gen.sh there). */
typedef struct {
    const char *name;     /* losses/<name>.json */
    const char *words[6]; /* the case's keys beyond the base words (as gen.sh passes them) */
    double rtol;          /* required agreement */
    double at_least;      /* a known difference must stay above this (0: none) */
    const char *known;    /* that known difference, in words (with at_least > 0) */
} family_loss_case;

/* For each case: every base word and case word was given to MaxText's run; shardsim trains one step
 * from its init (learning_rate 1e-2) to a checkpoint, then two steps from it (learning_rate 1e-3), on
 * hardware=cpu; both losses equal MaxText's within rtol (and, with at_least, differ by more than it
 * at step 0); MaxText's step moved the loss by more than 100 rtol (unless a known difference).
 * tag names the temporary directory. */
void family_check_losses(const char *tag, const char *const *base, int nbase, const family_loss_case *cases,
                         int ncases);

/* MaxText's loss protocol (losses/gen.sh): `shardsim train` of words on hardware=cpu, one step from
 * its init (learning_rate 1e-2) to a checkpoint in a temporary directory named by tag, then two
 * steps from that checkpoint (learning_rate 1e-3); loss[] the two steps' losses. */
void family_two_step_losses(const char *tag, const char *const *words, int nwords, double loss[2]);
/* Fails unless every word is among the measurement's "overrides" (MaxText's run got it). */
void family_check_overrides(const cfg_json *peer, const char *name, const char *const *words, int nwords);

/* dump_compare_025 against tests/data/maxtext-0.2.5/goldens/<model>/cpu-8/<mesh>; returns the leaves
 * compared. */
int family_check_dump(const char *what, const char *model, const char *mesh, int nargs, const char *const *args);

/* The dumps of a family whose feed-forward half is the routed experts against MaxText's: model
 * `small` on fsdp=4 expert=2, `large` on fsdp=2 tensor=2 expert=2 on the dense path
 * (sparse_matmul=false); each at least 12 parameters with their two Adam moments. */
void family_check_moe_dumps(const char *small, const char *large);

/* One mesh of the parity check: its devices and up to 5 words. */
typedef struct {
    int devices;
    const char *words[5];
} family_mesh;

/* Trains `tiny` (rows, steps) on one device, then on each mesh, and requires the losses and every
 * gradient equal (model_run_compare). */
void family_check_parity(const char *const *tiny, int ntiny, int rows, int steps, const family_mesh *meshes,
                         int nmeshes);

/* One refusal: `word` (and word2 if set) on top of the base words must exit 2 with an error naming
 * `key` and containing `also`. */
typedef struct {
    const char *word, *key, *also, *word2;
} family_refusal;

/* `shardsim train` of `tiny` with steps=1 per_device_batch_size=8 and each case's words. */
void family_check_refusals(const char *const *tiny, int ntiny, const family_refusal *cases, int ncases);

/* The refusals every family of the dense layer makes (model_dense_refuse, model_dense_setup:
 * attention_type, sliding windows, rope_type, mtp_num_layers, the batch-split schedule), then the
 * family's own. */
void family_check_dense_refusals(const char *const *tiny, int ntiny, const family_refusal *own, int nown);

/* family_check_parity over the meshes every family of the dense layer is checked on (data, fsdp,
 * tensor, context; explicit mode on fsdp, on data with `second`, on a sharded sequence with the
 * flash kernel, and with remat_policy=minimal on fsdp with `second`), then the family's own. */
void family_check_dense_parity(const char *const *tiny, int ntiny, int rows, int steps, const char *second,
                               const family_mesh *own, int nown);
/* The same for a family whose feed-forward half is the routed experts: `second` the expert axis,
 * and the expert meshes (expert, fsdp with expert, expert with tensor on the dense path, data fsdp
 * expert with norm_word). */
void family_check_moe_parity(const char *const *tiny, int ntiny, int rows, int steps, const char *norm_word);

/* The routed experts' parameters under params.decoder.layers.<scope> (no gate bias, no dense MLP, no
 * shared experts): the gate (emb, layers, experts) with ("embed", ..., None), wi_0 and wo of that
 * width with ("exp", ...) and mlp_moe. */
void family_check_routed_params(const model_def *def, const char *scope, int64_t emb, int64_t layers,
                                int64_t experts, int64_t width);

#endif
