/* test_cli_report_html.c — report.html of `train` and `parity`.
 *
 * The page must be self-contained (no network: no external script, style,
 * image or font), carry the run's data, and render in a real browser without
 * a script error, every section holding a chart or table with data.  The
 * browser is Debian's headless Chromium, which .ci/install-deps installs
 * (the rendering checks are skipped, saying so, where it is absent); the page
 * records on <body> whether its script finished (data-status="ok"), any error
 * (data-error) and, on each chart, how many data points it drew.
 *
 * train's page draws every parameter and one layer's activations on the
 * device grid (the sharding view); parity's compares the configurations: the
 * verdict with the first diverging step and parameter, memory per device by
 * category, bytes per collective x mesh axes x phase and the modelled step
 * time, each against the first configuration. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
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

static const char *MODEL[] = {
    "base_num_decoder_layers=2", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=4",    "head_dim=16",
    "base_mlp_dim=128",          "vocab_size=256",  "max_target_length=32",   "per_device_batch_size=2"};
enum { NMODEL = sizeof MODEL / sizeof MODEL[0] };

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

/* Every section of the page (a div holding an <h2>) holds at least one chart or table with
 * data; returns the number of sections. */
static int check_sections(const char *dom)
{
    const char *p = strstr(dom, "<div id=\"sections\">");
    assert_non_null(p);
    int n = 0;
    const char *h = strstr(p, "<h2>");
    while (h) {
        const char *next = strstr(h + 4, "<h2>");
        const char *title_end = strstr(h, "</h2>");
        assert_non_null(title_end);
        char title[128];
        snprintf(title, sizeof title, "%.*s", (int)(title_end - h - 4), h + 4);
        bool ok = false;
        for (const char *c = strstr(h, "data-points=\""); c && (!next || c < next); c = strstr(c + 1, "data-points=\""))
            if (strtol(c + 13, NULL, 10) > 0) ok = true;
        if (!ok) fail_msg("section '%s' of the rendered report holds no data", title);
        n++;
        h = next;
    }
    return n;
}

/* The text of the card (sharding view) whose title starts with name: up to the next card. */
static char *card(const char *dom, const char *name)
{
    char key[256];
    snprintf(key, sizeof key, "<div class=\"cardtitle\">%s ", name);
    const char *c = strstr(dom, key);
    if (!c) fail_msg("no card for '%s' in the sharding view", name);
    const char *end = strstr(c + 1, "<div class=\"cardtitle\">");
    size_t n = end ? (size_t)(end - c) : strlen(c);
    char *s = malloc(n + 1);
    memcpy(s, c, n);
    s[n] = '\0';
    return s;
}

static int count(const char *s, const char *what)
{
    int n = 0;
    for (const char *p = strstr(s, what); p; p = strstr(p + 1, what)) n++;
    return n;
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
    helper_assert_self_contained(html);
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
    char *dom = helper_render_html(dir, path);
    if (!dom) return;
    const char *charts[] = {
        "loss", "mesh", "traffic", "traffic-by-layer", "memory", "sharding-params", "sharding-activations"};
    int drawn = check_rendered(dom, charts, 7);
    assert_int_equal(drawn, 7);
    assert_int_equal(check_sections(dom), 6); /* loss, mesh, traffic x2, memory, sharding */
    /* the mesh grid draws the 4 devices, the memory chart 4 devices x 7 categories */
    assert_non_null(strstr(dom, "data-chart=\"mesh\" data-points=\"4\""));
    assert_non_null(strstr(dom, "data-chart=\"memory\" data-points=\"28\""));
    /* the sharding view: MaxText's Llama2 decoder has 12 parameters (token_embedder, the scanned
     * layers' query/key/value/out, wi_0/wi_1/wo and two norms, decoder_norm, logits_dense), and
     * every activation of the dump is drawn */
    assert_non_null(strstr(dom, "data-chart=\"sharding-params\" data-points=\"12\""));
    snprintf(path, sizeof path, "%s/train/input_shardings.json", dir);
    char *inputs = helper_read_file_opt(path, NULL);
    assert_non_null(inputs);
    char want[128];
    snprintf(want, sizeof want, "data-chart=\"sharding-activations\" data-points=\"%d\"",
             count(inputs, "\"logic_axes\""));
    assert_non_null(strstr(dom, want));
    free(inputs);
    /* devices are numbered row-major over (fsdp, tensor): device = 2 fsdp + tensor.  The final
     * norm's scale, logical (norm) -> tensor, is split in two, each half on the devices of one
     * tensor index (0,2 and 1,3); wi_0 (embed, layers, mlp) -> (fsdp, None, tensor) has four
     * shards, one device each, fsdp down the rows */
    char *c = card(dom, "decoder/decoder_norm/scale");
    assert_non_null(strstr(c, "logical: (norm)"));
    assert_non_null(strstr(c, "physical: P(tensor)"));
    assert_int_equal(count(c, "<rect"), 2);
    assert_non_null(strstr(c, "<title>devices 0,2</title>"));
    assert_non_null(strstr(c, "<title>devices 1,3</title>"));
    free(c);
    c = card(dom, "decoder/layers/mlp/wi_0/kernel");
    assert_non_null(strstr(c, "logical: (embed, layers, mlp)"));
    assert_non_null(strstr(c, "physical: P(fsdp, None, tensor)"));
    assert_int_equal(count(c, "<rect"), 4);
    for (int d = 0; d < 4; d++) {
        snprintf(want, sizeof want, "<title>devices %d</title>", d);
        assert_int_equal(count(c, want), 1);
    }
    /* tiles in row-major order: 0 1 / 2 3 */
    const char *t0 = strstr(c, "devices 0<"), *t1 = strstr(c, "devices 1<"), *t2 = strstr(c, "devices 2<");
    assert_true(t0 < t1 && t1 < t2);
    free(c);
    free(dom);
}

/* A failing parity run (unattainable rtol) overlays every configuration and
 * marks the failing steps. */
static void test_parity_report(void **state)
{
    (void)state;
    const char *argv[NMODEL + 5];
    int n = 0;
    for (int i = 0; i < NMODEL; i++) argv[n++] = MODEL[i];
    char od[300];
    snprintf(od, sizeof od, "output_dir=%s/parity", dir);
    argv[n++] = "steps=3";
    argv[n++] = "parity_rtol=1e-12";
    argv[n++] = "hardware_profile=v5p";
    argv[n++] = "configs=ici_fsdp_parallelism=1;ici_fsdp_parallelism=2;ici_tensor_parallelism=2 shard_mode=explicit";
    argv[n++] = od;
    cli_capture r = cli_capture_run(cli_cmd_parity, n, argv);
    assert_int_equal(r.rc, 1); /* rtol 1e-12 cannot hold across meshes */
    cli_capture_free(&r);

    char path[400];
    snprintf(path, sizeof path, "%s/parity/report.html", dir);
    char *html = helper_read_file_opt(path, NULL);
    assert_non_null(html);
    helper_assert_self_contained(html);
    free(html);
    char *dom = helper_render_html(dir, path);
    if (!dom) return;
    const char *charts[] = {"parity-verdict", "parity-loss",     "parity-table",    "parity-summary",
                            "parity-memory",  "parity-memory-0", "parity-memory-1", "parity-memory-2",
                            "parity-traffic", "parity-step-time"};
    assert_int_equal(check_rendered(dom, charts, 10), 10);
    /* verdict, loss, table, side by side, memory, traffic, step time */
    assert_int_equal(check_sections(dom), 7);
    assert_non_null(strstr(dom, "data-chart=\"parity-loss\" data-points=\"9\"")); /* 3 configs x 3 steps */
    assert_non_null(strstr(dom, "class=\"fail\""));                               /* a failing row marked */
    /* the verdict names the first diverging step and parameter, as parity.json has them */
    snprintf(path, sizeof path, "%s/parity/parity.json", dir);
    char *pj = helper_read_file_opt(path, NULL);
    assert_non_null(pj);
    const char *fp = strstr(pj, "\"first_diverging_param\": \"");
    assert_non_null(fp);
    char param[200], want[300];
    snprintf(param, sizeof param, "%.*s", (int)strcspn(fp + 26, "\""), fp + 26);
    const char *fs = strstr(pj, "\"first_diverging_step\": ");
    assert_non_null(fs);
    snprintf(want, sizeof want, "FAIL</b>: first diverging step %ld, parameter %s", strtol(fs + 24, NULL, 10), param);
    if (!strstr(dom, want)) fail_msg("the verdict does not say '%s'", want);
    free(pj);
    /* memory side by side: 1, 2 and 2 devices x 7 categories; the table holds 7 categories and
     * the total for 3 configurations */
    assert_non_null(strstr(dom, "data-chart=\"parity-memory-0\" data-points=\"7\""));
    assert_non_null(strstr(dom, "data-chart=\"parity-memory-1\" data-points=\"14\""));
    assert_non_null(strstr(dom, "data-chart=\"parity-memory-2\" data-points=\"14\""));
    assert_non_null(strstr(dom, "data-chart=\"parity-memory\" data-points=\"24\""));
    /* one device sends nothing; the others' collectives are new against it; fsdp=2 gathers its
     * weights over fsdp and tensor=2 reduces over tensor */
    assert_non_null(strstr(dom, "<td class=\"l\">bytes sent per device (one step)</td><td class=\"\">0 B</td>"));
    assert_non_null(strstr(dom, "over fsdp (forward)"));
    assert_non_null(strstr(dom, "over tensor (forward)"));
    assert_non_null(strstr(dom, ", new)"));
    /* modelled on the profile given */
    assert_non_null(strstr(dom, "<td class=\"l\">hardware profile</td><td class=\"\">v5p</td>"));
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
