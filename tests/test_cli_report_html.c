/* test_cli_report_html.c — report.html of `train` and `parity`.
 *
 * The page must be self-contained (no network: no external script, style,
 * image or font), carry the run's data, and render in a real browser without
 * a script error, every chart holding data.  The browser is Debian's
 * headless Chromium, which .ci/install-deps installs; the page records on
 * <body> whether its script finished (data-status="ok"), any error
 * (data-error) and, on each chart, how many data points it drew. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "cli/cli.h"
#include "tests/cli_capture.h"
#include "tests/helpers.h"

static char dir[128];

static const char *MODEL[] = {"base_num_decoder_layers=2", "base_emb_dim=64", "base_num_query_heads=4",
                              "base_num_kv_heads=4", "head_dim=16", "base_mlp_dim=128", "vocab_size=256",
                              "max_target_length=32", "per_device_batch_size=2"};
enum { NMODEL = sizeof MODEL / sizeof MODEL[0] };

/* The page as headless Chromium leaves it after its scripts ran. */
static char *render(const char *html)
{
    const char *browsers[] = {"chromium", "chromium-browser", "google-chrome"};
    const char *found = NULL;
    char cmd[1024];
    for (size_t i = 0; i < sizeof browsers / sizeof browsers[0] && !found; i++) {
        snprintf(cmd, sizeof cmd, "command -v %s >/dev/null 2>&1", browsers[i]);
        if (system(cmd) == 0) found = browsers[i];
    }
    if (!found) fail_msg("no headless browser: install Debian's chromium (bash .ci/install-deps does)");
    char out[300];
    snprintf(out, sizeof out, "%s/dom.html", dir);
    snprintf(cmd, sizeof cmd,
             "timeout 120 %s --headless --no-sandbox --disable-gpu --no-first-run --user-data-dir=%s/profile "
             "--dump-dom file://%s > %s 2>/dev/null",
             found, dir, html, out);
    int rc = system(cmd);
    assert_int_equal(WIFEXITED(rc) ? WEXITSTATUS(rc) : -1, 0);
    char *dom = helper_read_file_opt(out, NULL);
    assert_non_null(dom);
    return dom;
}

/* Checks the rendered page: script finished, no error, each named chart drawn
 * with at least one data point, and returns the number of charts. */
static int check_rendered(const char *dom, const char *const *charts, int n)
{
    const char *body = strstr(dom, "<body");
    assert_non_null(body);
    const char *gt = strchr(body, '>');
    assert_non_null(gt);
    char tag[512];
    snprintf(tag, sizeof tag, "%.*s", (int)(gt - body), body);
    if (strstr(tag, "data-error")) fail_msg("script error in report.html: %s", tag);
    assert_non_null(strstr(tag, "data-status=\"ok\""));
    for (int i = 0; i < n; i++) {
        char key[128];
        snprintf(key, sizeof key, "data-chart=\"%s\" data-points=\"", charts[i]);
        const char *c = strstr(dom, key);
        if (!c) fail_msg("chart '%s' missing from the rendered report", charts[i]);
        long points = strtol(c + strlen(key), NULL, 10);
        if (points < 1) fail_msg("chart '%s' drew no data", charts[i]);
    }
    const char *dc = strstr(tag, "data-charts=\"");
    assert_non_null(dc);
    return (int)strtol(dc + 13, NULL, 10);
}

/* Self-contained: nothing is loaded from elsewhere. */
static void assert_self_contained(const char *html)
{
    assert_null(strstr(html, "<script src"));
    assert_null(strstr(html, "<link"));
    assert_null(strstr(html, "src=\"http"));
    assert_null(strstr(html, "href=\"http"));
    assert_null(strstr(html, "@import"));
    assert_null(strstr(html, "url("));
}

static void test_train_report(void **state)
{
    (void)state;
    const char *argv[NMODEL + 4];
    int n = 0;
    for (int i = 0; i < NMODEL; i++) argv[n++] = MODEL[i];
    char od[300];
    snprintf(od, sizeof od, "output_dir=%s/train", dir);
    argv[n++] = "ici_fsdp_parallelism=2";
    argv[n++] = "ici_tensor_parallelism=2";
    argv[n++] = "steps=4";
    argv[n++] = od;
    cli_capture r = cli_capture_run(cli_train, n, argv);
    if (r.rc) fprintf(stderr, "%s\n", r.err);
    assert_int_equal(r.rc, 0);
    cli_capture_free(&r);

    char path[400];
    snprintf(path, sizeof path, "%s/train/report.html", dir);
    char *html = helper_read_file_opt(path, NULL);
    assert_non_null(html);
    assert_self_contained(html);
    /* the run's own numbers are in the page: the first loss from metrics.json */
    snprintf(path, sizeof path, "%s/train/metrics.json", dir);
    char *metrics = helper_read_file_opt(path, NULL);
    assert_non_null(metrics);
    const char *loss = strstr(metrics, "\"loss\": ");
    assert_non_null(loss);
    char first_loss[32];
    snprintf(first_loss, sizeof first_loss, "%.*s", (int)strcspn(loss + 8, ","), loss + 8);
    assert_non_null(strstr(html, first_loss));
    free(metrics);
    free(html);

    snprintf(path, sizeof path, "%s/train/report.html", dir);
    char *dom = render(path);
    const char *charts[] = {"loss", "mesh", "traffic", "traffic-by-layer", "memory"};
    int drawn = check_rendered(dom, charts, 5);
    assert_int_equal(drawn, 5);
    /* the mesh grid draws the 4 devices, the memory chart 4 devices x 7 categories */
    assert_non_null(strstr(dom, "data-chart=\"mesh\" data-points=\"4\""));
    assert_non_null(strstr(dom, "data-chart=\"memory\" data-points=\"28\""));
    free(dom);
}

/* A failing parity run (unattainable rtol) overlays every configuration and
 * marks the failing steps. */
static void test_parity_report(void **state)
{
    (void)state;
    const char *argv[NMODEL + 4];
    int n = 0;
    for (int i = 0; i < NMODEL; i++) argv[n++] = MODEL[i];
    char od[300];
    snprintf(od, sizeof od, "output_dir=%s/parity", dir);
    argv[n++] = "steps=3";
    argv[n++] = "parity_rtol=1e-12";
    argv[n++] = "configs=ici_fsdp_parallelism=1;ici_fsdp_parallelism=2;ici_tensor_parallelism=2 shard_mode=explicit";
    argv[n++] = od;
    cli_capture r = cli_capture_run(cli_cmd_parity, n, argv);
    assert_int_equal(r.rc, 1); /* rtol 1e-12 cannot hold across meshes */
    cli_capture_free(&r);

    char path[400];
    snprintf(path, sizeof path, "%s/parity/report.html", dir);
    char *html = helper_read_file_opt(path, NULL);
    assert_non_null(html);
    assert_self_contained(html);
    free(html);
    char *dom = render(path);
    const char *charts[] = {"parity-loss", "parity-table"};
    assert_int_equal(check_rendered(dom, charts, 2), 2);
    assert_non_null(strstr(dom, "data-chart=\"parity-loss\" data-points=\"9\"")); /* 3 configs x 3 steps */
    assert_non_null(strstr(dom, "class=\"fail\""));                                 /* a failing row marked */
    free(dom);
}

static int setup(void **state)
{
    (void)state;
    snprintf(dir, sizeof dir, "/tmp/shardsim-report-test-%d", (int)getpid());
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s && mkdir -p %s", dir, dir);
    return system(cmd) == 0 ? 0 : -1;
}

static int teardown(void **state)
{
    (void)state;
    char cmd[400];
    snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
    return system(cmd) == 0 ? 0 : -1;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_train_report),
        cmocka_unit_test(test_parity_report),
    };
    return cmocka_run_group_tests(tests, setup, teardown);
}
