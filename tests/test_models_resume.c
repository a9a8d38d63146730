/* test_models_resume.c — resuming a run from a full-state checkpoint
 * (load_full_state_path, or checkpoint_dir's latest step):
 *   - a run of 5 steps saves after steps 0, 2 and 4 (MaxText's schedule);
 *     resumed from the checkpoint of step 2 on the same mesh it trains steps
 *     3 and 4 with bitwise the same losses and saves a step-4 file bitwise
 *     equal to the uninterrupted run's (so the parameters, the moments, the
 *     schedule, the update count and the data all continued where they
 *     stopped);
 *   - resumed on another mesh (ZeRO-1 on data=2 tensor=2 for AdamW), the
 *     losses of steps 3 and 4 agree with the uninterrupted run's within the
 *     parity tolerance;
 *   - both for AdamW and for Muon (whose AdamW leaves keep two moments and
 *     whose Muon leaves keep one).  The schedule warms up over step 0, so
 *     a resume that restarted the schedule, the count or the moments (the
 *     step-3 update would differ) or the data (step 3's batch) could not
 *     give the same step-3 and step-4 losses.
 * The expected values are the uninterrupted run's own losses and files:
 * resuming must reproduce them, whatever they are. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "models/core/checkpoint.h"
#include "models/core/train.h"
#include "tests/helpers.h"
#include "tests/model_run.h"

/* tests/data/tiny-llama.yml with a fixed seed, a rate large enough to move, a warm-up over the
 * saved steps and the z-loss */
static const char *const TINY[] = {TINY_LLAMA_YML, "init_weights_seed=3", "learning_rate=1e-2",
                                   "warmup_steps_fraction=0.3", "z_loss_multiplier=0.001"};
enum { NTINY = sizeof TINY / sizeof TINY[0], ROWS = 8, STEPS = 5, PERIOD = 2, SAVED = 2, LAST = STEPS - 1 };

static void open_run(model_run *r, const char *opt, const char *const *mesh, int nmesh, int devices)
{
    const char *extra[8];
    int n = 0;
    extra[n++] = opt;
    for (int i = 0; i < nmesh; i++) extra[n++] = mesh[i];
    model_run_open(r, TINY, NTINY, ROWS, extra, n, devices, STEPS);
}

static void rm_dir(const char *dir)
{
    char p[256];
    for (int s = 0; s <= STEPS; s++) {
        snprintf(p, sizeof p, "%s/step_%d.safetensors", dir, s);
        unlink(p);
    }
    rmdir(dir);
}

/* The uninterrupted run (saving every PERIOD steps into dir): its losses. */
static void full_run(const char *opt, const char *const *mesh, int nmesh, int devices, const char *dir, double *loss)
{
    model_run a;
    open_run(&a, opt, mesh, nmesh, devices);
    a.job.checkpoint_dir = dir;
    a.job.checkpoint_period = PERIOD;
    model_run_train(&a, false);
    for (int s = 0; s < STEPS; s++) loss[s] = a.job.stats[s].loss;
    model_run_close(&a);
}

/* A run resumed from ckpt (its step read as the CLI reads it), saving into dir (NULL: none). */
static void resumed_run(const char *opt, const char *const *mesh, int nmesh, int devices, const char *ckpt,
                        const char *dir, double *loss)
{
    long long step = -1;
    if (model_checkpoint_step(ckpt, &step) != SIM_OK) fail_msg("step: %s", sim_errmsg());
    assert_int_equal(step, SAVED);
    model_run b;
    open_run(&b, opt, mesh, nmesh, devices);
    b.job.load_path = ckpt;
    b.job.load_full_state = true;
    b.job.start_step = step + 1;
    b.job.checkpoint_dir = dir;
    b.job.checkpoint_period = PERIOD;
    model_run_train(&b, false);
    for (int s = 0; s < STEPS; s++) loss[s] = b.job.stats[s].loss;
    model_run_close(&b);
}

static void check_resume(const char *opt, const char *const *other, int nother)
{
    char dir[] = "/tmp/shardsim_resume_XXXXXX", dir2[] = "/tmp/shardsim_resume2_XXXXXX";
    assert_non_null(mkdtemp(dir));
    assert_non_null(mkdtemp(dir2));
    const char *mesh[] = {"ici_fsdp_parallelism=2", "ici_tensor_parallelism=2"};
    double ref[STEPS], same[STEPS], moved[STEPS];
    full_run(opt, mesh, 2, 4, dir, ref);
    char ck2[256], ck4[256], again4[256];
    snprintf(ck2, sizeof ck2, "%s/step_%d.safetensors", dir, SAVED);
    snprintf(ck4, sizeof ck4, "%s/step_%d.safetensors", dir, LAST);
    snprintf(again4, sizeof again4, "%s/step_%d.safetensors", dir2, LAST);
    assert_int_equal(access(ck4, F_OK), 0);

    /* same mesh: bitwise */
    resumed_run(opt, mesh, 2, 4, ck2, dir2, same);
    for (int s = SAVED + 1; s < STEPS; s++)
        if (memcmp(&same[s], &ref[s], sizeof ref[s]))
            fail_msg("%s: resumed step %d loss %.9g, uninterrupted %.9g", opt, s, same[s], ref[s]);
    char p2[256];
    snprintf(p2, sizeof p2, "%s/step_%d.safetensors", dir2, SAVED);
    assert_int_equal(access(p2, F_OK), -1); /* the resumed run trains (and saves) from step 3 on */
    size_t na, nb;
    char *a = helper_read_file(ck4, &na), *b = helper_read_file(again4, &nb);
    assert_int_equal(na, nb);
    if (memcmp(a, b, na)) fail_msg("%s: the resumed run's step-4 checkpoint differs from the uninterrupted run's", opt);
    free(a);
    free(b);

    /* another mesh: within the parity tolerance */
    resumed_run(opt, other, nother, 4, ck2, NULL, moved);
    for (int s = SAVED + 1; s < STEPS; s++)
        if (fabs(moved[s] - ref[s]) > 1e-4 * fabs(ref[s]))
            fail_msg("%s on another mesh: resumed step %d loss %.9g, uninterrupted %.9g", opt, s, moved[s], ref[s]);
    rm_dir(dir);
    rm_dir(dir2);
}

static void test_resume_adamw(void **state)
{
    (void)state;
    const char *other[] = {"ici_data_parallelism=2", "ici_tensor_parallelism=2", "shard_optimizer_over_data=true"};
    check_resume("opt_type=adamw", other, 3);
}

static void test_resume_muon(void **state)
{
    (void)state;
    const char *other[] = {"ici_data_parallelism=2", "ici_tensor_parallelism=2"};
    check_resume("opt_type=muon", other, 2);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_resume_adamw),
        cmocka_unit_test(test_resume_muon),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
