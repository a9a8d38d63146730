/* test_cli_plan_report.c — `shardsim plan ... output_dir=DIR`: plan.json and report.html.
 *
 * One plan of the built-in small Llama over 4 devices with a made-up HBM of 4.5 MB, so that some
 * candidates fit and others run out of memory, is run once for the group.  plan.json's candidates
 * are checked against the printed table and blocks (step time, MFU, peak, summary, bound, command
 * line) and against the printed counts; the Pareto front is derived here from plan.json's step
 * times and peaks by its definition (no other fitting candidate as fast and as small and better in
 * one) and compared with what plan.json and the page mark.  The page is rendered in headless
 * Chromium where it is installed (as test_cli_report_html renders: skipped, saying so, without
 * it): every section holds content, the scatter draws every dry-run candidate with figures and
 * marks exactly the derived front.  A plan where nothing fits names the closest candidate, and
 * its plan.json is the same bytes on a second run. */
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "cli/cli.h"
#include "config/json.h"
#include "tests/cli_capture.h"
#include "tests/helpers.h"

static char *dir;          /* the group's folder */
static char plan_dir[512]; /* the mixed plan's output_dir */
static cli_capture mixed;  /* its run */

#define SMALL "configs/small.yml", "hardware_profile=v5p", "num_devices=4"

/* ------------------------------------------------------------ plan.json */

static const cfg_json *get(const cfg_json *o, const char *key) { return helper_json_get(o, key); }
static double num(const cfg_json *o, const char *key)
{
    const cfg_json *v = get(o, key);
    if (v->kind != CFG_JSON_NUMBER) fail_msg("plan.json: '%s' is not a number", key);
    return v->number;
}
static const char *str(const cfg_json *o, const char *key)
{
    const cfg_json *v = get(o, key);
    if (v->kind != CFG_JSON_STRING) fail_msg("plan.json: '%s' is not a string", key);
    return v->str;
}
static bool is(const cfg_json *c, const char *state) { return !strcmp(str(c, "state"), state); }
static bool has_figures(const cfg_json *c)
{
    return (is(c, "ranked") || is(c, "out_of_memory")) && num(c, "step_s") > 0 && num(c, "peak_bytes") > 0;
}
static bool close_rel(double a, double b, double rel) { return fabs(a - b) <= rel * fmax(fabs(a), fabs(b)) + 1e-300; }

/* The Pareto front by its definition, over the ranked candidates: front[id] set for its members;
 * returns how many. */
static int derive_front(const cfg_json *cands, bool *front)
{
    int n = 0;
    for (int i = 0; i < cands->n; i++) {
        const cfg_json *a = &cands->items[i];
        front[i] = false;
        if (!is(a, "ranked")) continue;
        bool dominated = false;
        for (int j = 0; j < cands->n && !dominated; j++) {
            const cfg_json *b = &cands->items[j];
            if (j == i || !is(b, "ranked")) continue;
            double sa = num(a, "step_s"), sb = num(b, "step_s"), pa = num(a, "peak_bytes"), pb = num(b, "peak_bytes");
            dominated = sb <= sa && pb <= pa && (sb < sa || pb < pa);
        }
        front[i] = !dominated;
        n += !dominated;
    }
    return n;
}

/* The number printed just before label on its line ("  1848 rejected by ..."). */
static long long count_before(const char *text, const char *label)
{
    const char *p = strstr(text, label);
    if (!p) fail_msg("'%s' not in the output", label);
    while (p > text && p[-1] == ' ') p--;
    const char *q = p;
    while (q > text && q[-1] >= '0' && q[-1] <= '9') q--;
    return atoll(q);
}

/* ------------------------------------------------------------ the page (as test_cli_report_html) */

/* The DOM after the page's script ran, its script finished without error; NULL (the test skipped,
 * saying so) without a browser. */
static char *render(const char *html)
{
    char *dom = helper_render_html(dir, html);
    if (!dom) return NULL;
    const char *body = strstr(dom, "<body");
    assert_non_null(body);
    char tag[512];
    snprintf(tag, sizeof tag, "%.*s", (int)strcspn(body, ">"), body);
    if (strstr(tag, "data-error")) fail_msg("script error in report.html: %s", tag);
    assert_contains(tag, "data-status=\"ok\"");
    return dom;
}

/* Every section (a div with an <h2>) holds a chart or table with data; returns how many. */
static int check_sections(const char *dom)
{
    const char *p = strstr(dom, "<div id=\"sections\">");
    assert_non_null(p);
    int n = 0;
    for (const char *h = strstr(p, "<h2>"), *next; h; h = next) {
        next = strstr(h + 4, "<h2>");
        bool ok = false;
        for (const char *c = strstr(h, "data-points=\""); c && (!next || c < next); c = strstr(c + 1, "data-points=\""))
            if (strtol(c + 13, NULL, 10) > 0) ok = true;
        if (!ok) fail_msg("section '%.60s' of the rendered report holds no data", h + 4);
        n++;
    }
    return n;
}

/* The data-points of chart name (-1 when it is not there). */
static long chart_points(const char *dom, const char *name)
{
    char key[128];
    snprintf(key, sizeof key, "data-chart=\"%s\" data-points=\"", name);
    const char *c = strstr(dom, key);
    return c ? strtol(c + strlen(key), NULL, 10) : -1;
}

/* ------------------------------------------------------------ tests */

/* Every printed table row and block is a ranked candidate of plan.json with the same figures,
 * summary, bound and command line; the counts add up to the printed ones. */
static void test_json_against_table(void **state)
{
    (void)state;
    cfg_json *root = helper_read_json(plan_dir, "plan.json");
    const cfg_json *cands = get(root, "candidates");
    const char *out = mixed.out;
    /* the table: "  rank   step (ms)     MFU   peak/device  candidate", then one row per rank */
    const char *row = strstr(out, "  rank   step (ms)");
    assert_non_null(row);
    row = strchr(row, '\n') + 1;
    int rows = 0;
    for (; *row && *row != '\n'; row = strchr(row, '\n') + 1) {
        int rank, pos = 0;
        double step_ms, mfu_pct, pv;
        char unit[8];
        assert_int_equal(sscanf(row, "%d %lf %lf%% %lf %7s %n", &rank, &step_ms, &mfu_pct, &pv, unit, &pos), 5);
        double scale = !strcmp(unit, "GiB")   ? 1073741824.0
                       : !strcmp(unit, "MiB") ? 1048576.0
                       : !strcmp(unit, "KiB") ? 1024.0
                                              : 1;
        const cfg_json *c = &cands->items[rank - 1]; /* the ranked come first, in rank order */
        assert_true(is(c, "ranked"));
        assert_int_equal((int)num(c, "rank"), rank);
        assert_true(fabs(1e3 * num(c, "step_s") - step_ms) <= 0.05 + 1e-9);
        assert_true(fabs(100 * num(c, "mfu") - mfu_pct) <= 0.05 + 1e-9);
        assert_true(close_rel(num(c, "peak_bytes"), pv * scale, 0.006)); /* printed to 3 digits */
        char summary[512];
        snprintf(summary, sizeof summary, "%.*s", (int)strcspn(row + pos, "\n"), row + pos);
        assert_string_equal(str(c, "summary"), summary);
        /* its block: "  #k   0.552 ms ...", the bound, then the command line */
        char marker[32];
        snprintf(marker, sizeof marker, "\n  #%-3d ", rank);
        const char *blk = strstr(out, marker);
        assert_non_null(blk);
        assert_true(fabs(1e3 * num(c, "step_s") - atof(blk + strlen(marker))) <= 0.0005 + 1e-9);
        const char *b = strstr(blk, "      bound: ");
        assert_non_null(b);
        assert_int_equal(strncmp(b + 13, str(c, "bound"), strlen(str(c, "bound"))), 0);
        const char *cmd = strstr(blk, "      $ ");
        assert_non_null(cmd);
        assert_int_equal((int)strcspn(cmd + 8, "\n"), (int)strlen(str(c, "command")));
        assert_int_equal(strncmp(cmd + 8, str(c, "command"), strlen(str(c, "command"))), 0);
        assert_null(
            strstr(str(c, "command"), "output_dir")); /* a train run of it must not overwrite the plan's files */
        rows++;
    }
    assert_int_equal(rows, 10); /* plan_top's default */

    /* every candidate once, with an id in order; the figures are whole */
    long long by[8] = {0}, records[8] = {0}, total = 0, unmade = 0;
    const char *states[8] = {"ranked",      "out_of_memory", "failed", "same_figures",
                             "not_dry_run", "equivalent",    "pruned", "rejected"};
    double hbm = num(root, "hbm_bytes");
    for (int i = 0; i < cands->n; i++) {
        const cfg_json *c = &cands->items[i];
        assert_int_equal((int)num(c, "id"), i);
        int s = 0;
        while (s < 8 && !is(c, states[s])) s++;
        if (s == 8) fail_msg("candidate %d: unknown state %s", i, str(c, "state"));
        by[s] += (long long)num(c, "candidates");
        records[s]++;
        total += (long long)num(c, "candidates");
        /* a dry-run structure whose knob variants were not made: they are beyond the budget */
        if (s <= 3) {
            assert_int_equal((int)num(c, "candidates"), 1);
            unmade += (long long)num(c, "variants_not_dry_run");
        }
        assert_int_equal(strncmp(str(c, "command"), "shardsim train ", 15), 0);
        if (s >= 1) assert_true(get(c, "reason")->kind == CFG_JSON_STRING || s == 0);
        if (s == 0 || s == 1 || s == 3) {
            /* the peak is its categories' sum; the step time its parts' (compute holds the bubbles) */
            const cfg_json *m = get(c, "memory"), *t = get(c, "step_time");
            double sum = 0;
            for (int k = 0; k < m->n; k++) sum += m->items[k].number;
            assert_true(close_rel(sum, num(c, "peak_bytes"), 1e-12));
            assert_true(close_rel(num(t, "compute_s") + num(t, "optimizer_s") + num(t, "exposed_communication_s"),
                                  num(c, "step_s"), 1e-9));
            assert_true(
                close_rel(num(c, "mfu"), num(t, "model_flops") / (num(c, "step_s") * num(t, "peak_flops")), 1e-9));
        }
        if (s == 0) assert_true(num(c, "peak_bytes") <= hbm);
        if (s == 1 && strncmp(str(c, "reason"), "out of memory in the full dry run", 33))
            assert_true(num(c, "peak_bytes") > hbm);
        if (s == 5) assert_true(num(c, "same_as") < i);
    }
    assert_true(records[0] > 0 && records[1] > 0 && by[6] > 0 && by[7] > 0); /* the plan holds every kind */
    assert_int_equal(total + unmade, count_before(out, "candidates considered"));
    assert_int_equal(by[0], count_before(out, "fit and are ranked"));
    assert_int_equal(by[7], count_before(out, "rejected by the checks"));
    assert_int_equal(by[6], count_before(out, "pruned: parameters"));
    assert_int_equal(by[5], count_before(out, "equivalent to an earlier candidate"));
    assert_int_equal(records[0] + records[1] + records[2] + records[3], count_before(out, "dry-run: "));
    assert_int_equal(records[1], count_before(out, "out of memory, "));
    assert_int_equal(by[4] + unmade, count_before(out, "not dry-run: beyond"));
    cfg_json_free(root);
}

/* The front plan.json marks is the one its own figures give. */
static void test_pareto_front(void **state)
{
    (void)state;
    cfg_json *root = helper_read_json(plan_dir, "plan.json");
    const cfg_json *cands = get(root, "candidates"), *listed = get(root, "pareto");
    bool *front = calloc((size_t)cands->n, sizeof *front);
    int n = derive_front(cands, front);
    assert_true(n >= 3);                                      /* a front, not a point */
    assert_true(n < (int)num(get(root, "counts"), "ranked")); /* and not everything */
    assert_true(front[0]);                                    /* the fastest is on it */
    for (int i = 0; i < cands->n; i++)
        if (get(&cands->items[i], "pareto")->boolean != front[i])
            fail_msg("candidate %d (%s): plan.json says pareto=%d, its figures say %d", i,
                     str(&cands->items[i], "summary"), get(&cands->items[i], "pareto")->boolean, front[i]);
    assert_int_equal(listed->n, n);
    for (int k = 0; k < listed->n; k++) assert_true(front[listed->items[k].integer]);
    free(front);
    cfg_json_free(root);
}

/* The page draws plan.json: each section holds content, the scatter every dry-run candidate with
 * figures and exactly the derived front, the HBM line, the winner's breakdown. */
static void test_report_page(void **state)
{
    (void)state;
    char path[700];
    snprintf(path, sizeof path, "%s/report.html", plan_dir);
    char *html = helper_read_file(path, NULL);
    helper_assert_self_contained(html);
    cfg_json *root = helper_read_json(plan_dir, "plan.json");
    const cfg_json *cands = get(root, "candidates");
    /* the winner's command line is in the page (its JSON string: '/' may not be escaped) */
    assert_contains(html, str(&cands->items[0], "summary"));
    free(html);
    char *dom = render(path);
    if (!dom) {
        cfg_json_free(root);
        return;
    }
    assert_int_equal(check_sections(dom), 4); /* ranking, scatter, winner, outcomes */
    int points = 0, ranked = 0;
    for (int i = 0; i < cands->n; i++) {
        points += has_figures(&cands->items[i]);
        ranked += is(&cands->items[i], "ranked");
    }
    assert_int_equal(chart_points(dom, "plan-scatter"), points);
    assert_int_equal(chart_points(dom, "plan-ranking"), ranked);
    assert_int_equal(chart_points(dom, "plan-winner-memory"), 7); /* one bar, every category */
    assert_int_equal(chart_points(dom, "plan-winner-time"), 4);   /* compute, bubbles, optimizer, exposed */
    assert_true(chart_points(dom, "plan-winner-axes") >= 1);
    assert_true(chart_points(dom, "plan-reasons") >= 1);
    /* every circle is a candidate with figures; those marked are the derived front */
    bool *front = calloc((size_t)cands->n, sizeof *front);
    int nfront = derive_front(cands, front), circles = 0, marked = 0;
    for (const char *c = strstr(dom, "<circle"); c; c = strstr(c + 1, "<circle")) {
        const char *id = strstr(c, "data-id=\""), *pf = strstr(c, "data-pareto=\"");
        assert_true(id && pf && id < strchr(c, '>') && pf < strchr(c, '>'));
        long k = strtol(id + 9, NULL, 10);
        assert_true(k >= 0 && k < cands->n && has_figures(&cands->items[k]));
        bool on = pf[13] == '1';
        if (on != front[k]) fail_msg("circle of candidate %ld: data-pareto=%d, its figures say %d", k, on, front[k]);
        circles++;
        marked += on;
    }
    assert_int_equal(circles, points);
    assert_int_equal(marked, nfront);
    /* the HBM line at plan.json's HBM, and the winner's section names rank 1 */
    char want[600];
    snprintf(want, sizeof want, "data-hbm=\"%.17g\"", num(root, "hbm_bytes"));
    if (!strstr(dom, want)) {
        snprintf(want, sizeof want, "data-hbm=\"%.0f\"", num(root, "hbm_bytes"));
        assert_contains(dom, want);
    }
    snprintf(want, sizeof want, "<h2>The winner: #1 %s</h2>", str(&cands->items[0], "summary"));
    assert_contains(dom, want);
    free(front);
    free(dom);
    cfg_json_free(root);
}

/* Nothing fits: exit 1, no winner, the closest is the dry-run candidate with the smallest peak; the
 * page shows it; plan.json is the same bytes on a second run. */
static void test_nothing_fits(void **state)
{
    (void)state;
    char od[600], word[700];
    snprintf(od, sizeof od, "%s/nofit", dir);
    snprintf(word, sizeof word, "output_dir=%s", od);
    const char *argv[] = {SMALL, "hbm_limit_gb=0.003", "plan_dry_runs=6", word};
    cli_capture r = cli_capture_run(cli_plan, sizeof argv / sizeof argv[0], argv);
    assert_int_equal(r.rc, 1);
    assert_contains(r.out, "no candidate fits");
    cli_capture_free(&r);
    size_t n1 = 0, n2 = 0;
    char *first = helper_read_in(od, "plan.json", &n1);
    cfg_json *root = helper_read_json(od, "plan.json");
    assert_int_equal(get(root, "winner")->kind, CFG_JSON_NULL);
    assert_int_equal(get(root, "pareto")->n, 0);
    const cfg_json *cands = get(root, "candidates");
    int best = -1;
    for (int i = 0; i < cands->n; i++)
        if (is(&cands->items[i], "out_of_memory") &&
            (best < 0 || num(&cands->items[i], "peak_bytes") < num(&cands->items[best], "peak_bytes")))
            best = i;
    assert_true(best >= 0);
    assert_int_equal((int)num(root, "closest"), best);

    r = cli_capture_run(cli_plan, sizeof argv / sizeof argv[0], argv);
    assert_int_equal(r.rc, 1);
    cli_capture_free(&r);
    char *second = helper_read_in(od, "plan.json", &n2);
    assert_int_equal(n1, n2);
    assert_memory_equal(first, second, n1);
    free(first);
    free(second);

    char path[700];
    snprintf(path, sizeof path, "%s/report.html", od);
    char *dom = render(path);
    if (dom) {
        assert_int_equal(check_sections(dom), 4); /* the closest ones, scatter, the closest, outcomes */
        int oom = 0;
        for (int i = 0; i < cands->n; i++) oom += has_figures(&cands->items[i]);
        assert_int_equal(chart_points(dom, "plan-scatter"), oom);
        assert_int_equal(chart_points(dom, "plan-ranking"), -1);
        assert_true(chart_points(dom, "plan-closest") >= 1);
        char want[600];
        snprintf(want, sizeof want, "<h2>The closest: %s</h2>", str(&cands->items[best], "summary"));
        assert_contains(dom, want);
        assert_null(strstr(dom, "data-pareto=\"1\""));
        free(dom);
    }
    cfg_json_free(root);
}

/* An output_dir that cannot be made: exit 2 naming the key, before any search, nothing printed. */
static void test_bad_output_dir(void **state)
{
    (void)state;
    char file[600], word[700];
    snprintf(file, sizeof file, "%s/a-file", dir);
    helper_write_file(file, "x", 1);
    const char *bad[] = {"output_dir=/dev/null/x", word};
    snprintf(word, sizeof word, "output_dir=%s", file);
    for (int i = 0; i < 2; i++) {
        const char *argv[] = {SMALL, bad[i]};
        cli_capture r = cli_capture_run(cli_plan, sizeof argv / sizeof argv[0], argv);
        assert_int_equal(r.rc, 2);
        assert_contains(r.err, bad[i]);
        assert_string_equal(r.out, "");
        cli_capture_free(&r);
    }
}

static int group_setup(void **state)
{
    (void)state;
    dir = helper_tmpdir("plan_report");
    snprintf(plan_dir, sizeof plan_dir, "%s/mixed", dir);
    char word[600];
    snprintf(word, sizeof word, "output_dir=%s", plan_dir);
    /* 4.5 MB of HBM: the small model's candidates peak between 3.4 and 6.5 MiB */
    const char *argv[] = {SMALL, "hbm_limit_gb=0.0045", word};
    mixed = cli_capture_run(cli_plan, sizeof argv / sizeof argv[0], argv);
    if (mixed.rc != 0) {
        fprintf(stderr, "plan failed (%d): %s\n", mixed.rc, mixed.err);
        return -1;
    }
    return 0;
}

static int group_teardown(void **state)
{
    (void)state;
    cli_capture_free(&mixed);
    helper_rm_rf(dir);
    free(dir);
    return 0;
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_json_against_table), cmocka_unit_test(test_pareto_front),
        cmocka_unit_test(test_report_page),        cmocka_unit_test(test_nothing_fits),
        cmocka_unit_test(test_bad_output_dir),
    };
    return cmocka_run_group_tests(tests, group_setup, group_teardown);
}
