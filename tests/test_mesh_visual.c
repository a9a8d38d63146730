/* test_mesh_visual.c — mesh/visual.h: the picture of a sharding, read back cell by cell.
 * Device ids are row-major over the mesh (x most significant), so on x=2 x y=2 device 2x+y holds
 * block (x, y) of P('x', 'y'); every expectation below follows from that rule:
 *   - P('x', 'y') on (4, 4): a 2 x 2 grid, rows "0","1" / "2","3";
 *   - P('x', None) on (4, 8): one column of two cells, "0,1" (x = 0) over "2,3";
 *   - replicated: one cell naming every device as a range "0-3";
 *   - P(('y', 'x'), None): y most significant in the dim, so the rows are 0, 2, 1, 3;
 *   - rank 3 with one sharded dim: the grid over that dim; three sharded dims: one line per block
 *     with its index ranges;
 *   - partial axes are named under the grid;
 *   - the header names the spec, the global shape and the block shape. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "mesh/visual.h"
#include "tests/helpers.h"

typedef struct {
    char *text;
    int rows;           /* grid rows (border lines - 1) */
    char cells[16][32]; /* labels of the cells, in reading order */
    int ncells;
} picture;

static picture draw(const mesh_shape *m, const char *spec, int rank, const int64_t *shape)
{
    mesh_spec s = helper_spec(m, spec);
    picture p;
    memset(&p, 0, sizeof p);
    size_t len = 0;
    FILE *f = open_memstream(&p.text, &len);
    mesh_visualize(f, m, &s, rank, shape);
    fclose(f);
    int borders = 0;
    char *save = NULL, *copy = strdup(p.text);
    for (char *line = strtok_r(copy, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (line[0] == '+') borders++;
        if (line[0] != '|') continue;
        char *cs = NULL;
        for (char *cell = strtok_r(line, "|", &cs); cell; cell = strtok_r(NULL, "|", &cs)) {
            char lab[32];
            if (sscanf(cell, " %31s", lab) == 1 && p.ncells < 16) snprintf(p.cells[p.ncells++], 32, "%s", lab);
        }
    }
    free(copy);
    p.rows = borders ? borders - 1 : 0;
    return p;
}

static mesh_shape mesh22(void)
{
    static const char *const names[] = {"x", "y"};
    static const int sizes[] = {2, 2};
    return helper_mesh(2, names, sizes);
}

static void expect_cells(const picture *p, int rows, const char *const *labels, int n)
{
    if (p->rows != rows || p->ncells != n)
        fail_msg("%d rows, %d labelled cells; expected %d, %d:\n%s", p->rows, p->ncells, rows, n, p->text);
    for (int i = 0; i < n; i++)
        if (strcmp(p->cells[i], labels[i]))
            fail_msg("cell %d is '%s', expected '%s':\n%s", i, p->cells[i], labels[i], p->text);
}

static void test_two_dims(void **state)
{
    (void)state;
    mesh_shape m = mesh22();
    int64_t sq[2] = {4, 4}, wide[2] = {4, 8};
    picture p = draw(&m, "P('x', 'y')", 2, sq);
    static const char *const xy[] = {"0", "1", "2", "3"};
    expect_cells(&p, 2, xy, 4);
    assert_contains(p.text, "P('x', 'y') on shape (4, 4): blocks of (2, 2), 2 x 2");
    free(p.text);
    p = draw(&m, "P('x', None)", 2, wide);
    static const char *const rows[] = {"0,1", "2,3"};
    expect_cells(&p, 2, rows, 2);
    free(p.text);
    p = draw(&m, "P(None, None)", 2, wide);
    static const char *const all[] = {"0-3"};
    expect_cells(&p, 1, all, 1);
    free(p.text);
    p = draw(&m, "P(('y', 'x'), None)", 2, wide);
    static const char *const yx[] = {"0", "2", "1", "3"};
    expect_cells(&p, 4, yx, 4);
    free(p.text);
}

static void test_higher_rank(void **state)
{
    (void)state;
    mesh_shape m = mesh22();
    int64_t s3[3] = {2, 6, 4};
    picture p = draw(&m, "P(None, None, 'y')", 3, s3);
    static const char *const cols[] = {"0,2", "1,3"};
    expect_cells(&p, 1, cols, 2);
    assert_contains(p.text, "columns: dim 2");
    free(p.text);
    static const char *const names[] = {"a", "b", "c"};
    static const int sizes[] = {2, 2, 2};
    mesh_shape m3 = helper_mesh(3, names, sizes);
    int64_t s4[3] = {4, 6, 8};
    p = draw(&m3, "P('a', 'b', 'c')", 3, s4);
    assert_int_equal(p.rows, 0);
    assert_contains(p.text, "one line per block");
    assert_contains(p.text, "[0:2, 0:3, 0:4]  devices 0\n");
    assert_contains(p.text, "[2:4, 3:6, 4:8]  devices 7\n");
    free(p.text);
}

static void test_partial(void **state)
{
    (void)state;
    mesh_shape m = mesh22();
    int64_t sq[2] = {4, 4};
    mesh_spec s;
    assert_int_equal(mesh_spec_parse("P('x', None)", &m, &s), SIM_OK);
    s.partial = 1u << 1; /* partial over y */
    char *text = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&text, &len);
    mesh_visualize(f, &m, &s, 2, sq);
    fclose(f);
    assert_contains(text, "partial sums over: y");
    free(text);
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_two_dims),
        cmocka_unit_test(test_higher_rank),
        cmocka_unit_test(test_partial),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
