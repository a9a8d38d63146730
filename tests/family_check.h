/* family_check.h — test support: the checks the decoder-family tests (mistral, mixtral, qwen3,
 * qwen3_moe) share, each test keeping its own cases and expected values: the loss against real
 * MaxText 0.2.5 (tests/data/maxtext-0.2.5/losses), the sharding dump against MaxText's, the parity of
 * every mesh with one device, and the refusals naming the key.  Failures end the test (cmocka). */
#ifndef TESTS_FAMILY_CHECK_H
#define TESTS_FAMILY_CHECK_H

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

/* dump_compare_025 against tests/data/maxtext-0.2.5/goldens/<model>/cpu-8/<mesh>; returns the leaves
 * compared. */
int family_check_dump(const char *what, const char *model, const char *mesh, int nargs, const char *const *args);

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

#endif
