/* test_sim_trace.c — sim/trace.h: the devices' spans as Chrome trace-event JSON.
 *   - one process per device named by its mesh coordinates (size-1 axes left out), a compute lane
 *     and a lane per group of mesh axes, each collective an event carrying its record (bytes, tag
 *     with its quotes escaped), the arena's bytes; the output parses as JSON and holds exactly one
 *     complete ("X") event per span;
 *   - a limit on events keeps whole devices from device 0 while they fit, drops the spans of the
 *     others as they run, and a trace that would need dropped spans is refused (the writer's
 *     escapes: test_sim_jsonout.c). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "sim/collectives.h"
#include "sim/trace.h"
#include "tests/helpers.h"

static sim_machine *machine(int n, const char *const *names, const int *sizes, sim_machine_opts o)
{
    return helper_sim_machine_opts(n, names, sizes, o);
}

static sim_status traced_device(sim_device *d, void *arg)
{
    (void)arg;
    void *p;
    SIM_TRY(sim_arena_alloc(sim_device_arena(d), 4096, SIM_MEM_TEMP, "t", false, &p));
    int tok = sim_span_begin(d, "matmul");
    memset(p, 0, 4096);
    sim_span_end(d, tok);
    float x[4] = {1, 2, 3, 4}, y[8];
    sim_device_set_phase(d, SIM_PHASE_BACKWARD);
    SIM_TRY(sim_all_gather(d, x, y, 4, SIM_F32, sim_axes_1(1), sim_meta_tag("layer/\"q\"")));
    sim_arena_release(sim_device_arena(d), p, 4096, SIM_MEM_TEMP);
    return SIM_OK;
}

/* 1000 spans, a barrier (every device then holds 1000), 1000 more inside an outer span. */
enum { LIMIT_HALF = 1000 };
static sim_status many_spans(sim_device *d, void *arg)
{
    (void)arg;
    for (int i = 0; i < LIMIT_HALF; i++) sim_span_end(d, sim_span_begin(d, "a"));
    SIM_TRY(sim_device_barrier(d));
    int outer = sim_span_begin(d, "outer"); /* open across the point where a device drops its spans */
    for (int i = 0; i < LIMIT_HALF - 1; i++) sim_span_end(d, sim_span_begin(d, "b"));
    sim_span_end(d, outer);
    return SIM_OK;
}

static size_t count_of(const char *s, const char *what)
{
    size_t n = 0;
    for (const char *p = strstr(s, what); p; p = strstr(p + 1, what)) n++;
    return n;
}

static void test_trace_limit_drops_unwritten_devices(void **state)
{
    (void)state;
    const char *names[] = {"fsdp"};
    int sizes[] = {8};
    sim_machine_opts o = {0};
    o.trace = true;
    sim_machine *m = machine(1, names, sizes, o);
    size_t limit = 5 * LIMIT_HALF; /* devices 0 and 1 (4000 spans) fit, device 2 (6000) does not */
    sim_trace_set_limit(m, limit);
    assert_int_equal(sim_machine_run(m, many_spans, NULL), SIM_OK);
    for (int i = 0; i < 8; i++) assert_int_equal(sim_trace_span_count(m, i), 2 * LIMIT_HALF); /* counted, kept or not */
    assert_int_equal(sim_trace_devices_within(m, limit), 2);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_int_equal(sim_trace_write_chrome(m, f, limit), SIM_OK);
    fclose(f);
    assert_int_equal(count_of(buf, "\"ph\":\"X\""), 2 * 2 * LIMIT_HALF); /* every span of devices 0 and 1 */
    assert_int_equal(count_of(buf, "\"name\":\"outer\""), 2);
    assert_null(strstr(buf, "\"pid\":2"));
    free(buf);
    /* device 7 saw devices 0-6 at 1000 spans each after the barrier, so it dropped its spans:
     * a trace that would need them is refused, never read from freed memory */
    buf = NULL;
    f = open_memstream(&buf, &len);
    assert_int_equal(sim_trace_write_chrome(m, f, 0), SIM_ERR_INTERNAL);
    fclose(f);
    free(buf);
    sim_err_clear();
    sim_machine_free(m);
}

static void test_trace_json(void **state)
{
    (void)state;
    const char *names[] = {"data", "tensor"};
    int sizes[] = {1, 2};
    sim_machine_opts o = {0};
    o.trace = true;
    o.pin_threads = true;
    sim_machine *m = machine(2, names, sizes, o);
    assert_int_equal(sim_machine_run(m, traced_device, NULL), SIM_OK);
    assert_int_equal(sim_trace_span_count(m, 1), 2);
    size_t nr;
    const sim_record *r = sim_device_records(sim_machine_device(m, 1), &nr);
    assert_int_equal(nr, 1);
    assert_int_equal(r[0].phase, SIM_PHASE_BACKWARD);
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    assert_int_equal(sim_trace_write_chrome(m, f, 0), SIM_OK);
    fclose(f);
    assert_non_null(strstr(buf, "\"device 1 (tensor=1)\"")); /* size-1 axes are left out */
    assert_non_null(strstr(buf, "\"collectives tensor\""));
    assert_non_null(strstr(buf, "\"all-gather layer/\\\"q\\\"\""));
    assert_non_null(strstr(buf, "\"name\":\"matmul\""));
    assert_non_null(strstr(buf, "\"bytes\":4096"));
    assert_non_null(strstr(buf, "\"bytes_sent\":16"));
    /* balanced braces: a cheap structural check of the JSON */
    long depth = 0;
    int in_str = 0;
    for (size_t i = 0; i < len; i++) {
        char ch = buf[i];
        if (in_str) {
            if (ch == '\\') i++;
            else if (ch == '"') in_str = 0;
            continue;
        }
        if (ch == '"') in_str = 1;
        else if (ch == '{' || ch == '[') depth++;
        else if (ch == '}' || ch == ']') assert_true(--depth >= 0);
    }
    assert_int_equal(depth, 0);
    /* and it parses: one "X" event per span of each device, every one on device 0 or 1 */
    json_error_t err;
    json_t *root = json_loadb(buf, len, 0, &err);
    if (!root) fail_msg("trace is not JSON: %s (line %d)", err.text, err.line);
    json_t *events = json_is_array(root) ? root : json_object_get(root, "traceEvents");
    assert_true(json_is_array(events));
    size_t spans[2] = {0, 0}, i;
    json_t *e;
    json_array_foreach(events, i, e)
    {
        const char *ph = json_string_value(json_object_get(e, "ph"));
        json_int_t pid = json_integer_value(json_object_get(e, "pid"));
        assert_true(pid == 0 || pid == 1);
        if (ph && !strcmp(ph, "X")) spans[pid]++;
    }
    assert_int_equal(spans[0], sim_trace_span_count(m, 0));
    assert_int_equal(spans[1], sim_trace_span_count(m, 1));
    json_decref(root);
    free(buf);
    sim_machine_free(m);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_trace_json),
        cmocka_unit_test(test_trace_limit_drops_unwritten_devices),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
