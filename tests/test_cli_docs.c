/* test_cli_docs.c — the README and the docs/ book hold together.
 *
 *   - README.md fits on a screen: at most 200 lines;
 *   - every relative link of README.md and of docs/ (and docs/<part>/) points at a
 *     file that exists, read from the linking page's folder (an anchor after '#'
 *     is not checked, an http(s) or mailto link is skipped);
 *   - every page of docs/ is reachable from docs/README.md, the table of contents
 *     (by a link from it or from a page it links);
 *   - every ```sh block (a block bench/readme runs) is closed, so no page's output
 *     sample is taken for commands and none of its commands is lost.
 * Run from the repository root, as make test does. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <glob.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

enum { MAX_PAGES = 128, LINE_CAP = 8192 };

static const char *patterns[] = {"README.md", "docs/*.md", "docs/*/*.md"};

typedef struct {
    char path[PATH_MAX];
    int reached;
} page;

static page pages[MAX_PAGES];
static int n_pages;

static void list_pages(void)
{
    n_pages = 0;
    for (size_t i = 0; i < sizeof patterns / sizeof *patterns; i++) {
        glob_t g;
        if (glob(patterns[i], 0, NULL, &g) != 0) continue;
        for (size_t j = 0; j < g.gl_pathc && n_pages < MAX_PAGES; j++) {
            snprintf(pages[n_pages].path, sizeof pages[n_pages].path, "%s", g.gl_pathv[j]);
            pages[n_pages++].reached = 0;
        }
        globfree(&g);
    }
}

/* The target of a relative link, resolved against from's folder and normalised
 * ("a/b/../c" -> "a/c"), into out.  0 when the link is not a local file link. */
static int resolve(const char *from, const char *link, char *out, size_t cap)
{
    if (!strncmp(link, "http://", 7) || !strncmp(link, "https://", 8) || !strncmp(link, "mailto:", 7) ||
        link[0] == '#' || !link[0])
        return 0;
    char dir[PATH_MAX];
    snprintf(dir, sizeof dir, "%s", from);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = '\0';
    else strcpy(dir, ".");
    char joined[2 * PATH_MAX];
    snprintf(joined, sizeof joined, "%s/%s", dir, link);
    char *hash = strchr(joined, '#');
    if (hash) *hash = '\0';
    /* normalise the path's segments */
    char *parts[256];
    int n = 0;
    for (char *tok = strtok(joined, "/"); tok; tok = strtok(NULL, "/")) {
        if (!strcmp(tok, ".")) continue;
        if (!strcmp(tok, "..") && n > 0 && strcmp(parts[n - 1], "..")) {
            n--;
            continue;
        }
        if (n < 256) parts[n++] = tok;
    }
    out[0] = '\0';
    for (int i = 0; i < n; i++) {
        if (i) strncat(out, "/", cap - strlen(out) - 1);
        strncat(out, parts[i], cap - strlen(out) - 1);
    }
    return 1;
}

/* Calls fn(page, target) for every relative link "](target)" of the page outside code blocks. */
static void for_links(const char *path, void (*fn)(const char *, const char *, void *), void *arg)
{
    FILE *f = fopen(path, "r");
    assert_non_null(f);
    static char line[LINE_CAP];
    int in_code = 0;
    while (fgets(line, sizeof line, f)) {
        if (!strncmp(line, "```", 3)) {
            in_code = !in_code;
            continue;
        }
        if (in_code) continue;
        for (char *p = strstr(line, "]("); p; p = strstr(p + 2, "](")) {
            char *end = strchr(p + 2, ')');
            if (!end) break;
            char link[PATH_MAX];
            size_t len = (size_t)(end - (p + 2));
            if (len >= sizeof link) continue;
            memcpy(link, p + 2, len);
            link[len] = '\0';
            char target[PATH_MAX];
            if (resolve(path, link, target, sizeof target)) fn(path, target, arg);
        }
    }
    fclose(f);
}

static void check_exists(const char *from, const char *target, void *arg)
{
    int *broken = arg;
    if (access(target, F_OK) != 0) {
        fprintf(stderr, "broken link in %s: %s\n", from, target);
        (*broken)++;
    }
}

static void test_readme_fits_a_screen(void **state)
{
    (void)state;
    FILE *f = fopen("README.md", "r");
    assert_non_null(f);
    int lines = 0, c;
    while ((c = fgetc(f)) != EOF) lines += c == '\n';
    fclose(f);
    assert_true(lines > 20); /* the file is there and not a stub */
    assert_true(lines <= 200);
}

static void test_links_resolve(void **state)
{
    (void)state;
    list_pages();
    assert_true(n_pages >= 20);
    int broken = 0;
    for (int i = 0; i < n_pages; i++) for_links(pages[i].path, check_exists, &broken);
    assert_int_equal(broken, 0);
}

static void mark_reached(const char *from, const char *target, void *arg)
{
    int *changed = arg;
    for (int i = 0; i < n_pages; i++)
        if (!pages[i].reached && !strcmp(pages[i].path, target)) {
            pages[i].reached = 1;
            (*changed)++;
        }
}

static void test_every_page_reached_from_toc(void **state)
{
    (void)state;
    list_pages();
    for (int i = 0; i < n_pages; i++) pages[i].reached = !strcmp(pages[i].path, "docs/README.md");
    int changed = 1;
    while (changed) { /* links followed from every page reached so far, until nothing new */
        changed = 0;
        for (int i = 0; i < n_pages; i++)
            if (pages[i].reached && strcmp(pages[i].path, "README.md")) for_links(pages[i].path, mark_reached, &changed);
    }
    int unreached = 0;
    for (int i = 0; i < n_pages; i++)
        if (strcmp(pages[i].path, "README.md") && !pages[i].reached) {
            fprintf(stderr, "not reachable from docs/README.md: %s\n", pages[i].path);
            unreached++;
        }
    assert_int_equal(unreached, 0);
}

static void test_code_blocks_closed(void **state)
{
    (void)state;
    list_pages();
    for (int i = 0; i < n_pages; i++) {
        FILE *f = fopen(pages[i].path, "r");
        assert_non_null(f);
        static char line[LINE_CAP];
        int open = 0;
        while (fgets(line, sizeof line, f)) {
            if (strncmp(line, "```", 3)) continue;
            open = !open;
        }
        fclose(f);
        if (open) fprintf(stderr, "unclosed code block in %s\n", pages[i].path);
        assert_false(open);
    }
}

int main(void)
{
    const struct CMUnitTest tests[] = {
        cmocka_unit_test(test_readme_fits_a_screen),
        cmocka_unit_test(test_links_resolve),
        cmocka_unit_test(test_every_page_reached_from_toc),
        cmocka_unit_test(test_code_blocks_closed),
    };
    return cmocka_run_group_tests(tests, NULL, NULL);
}
