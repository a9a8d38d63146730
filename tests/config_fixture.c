/* config_fixture.c — see config_fixture.h. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <cmocka.h>

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "tests/config_fixture.h"

char *cfgt_mkdir(void) { return helper_tmpdir("cfgt"); }

void cfgt_rmdir(char *dir)
{
    helper_rm_rf(dir);
    free(dir);
}

char *cfgt_write(const char *dir, const char *name, const char *text)
{
    char *path = malloc(strlen(dir) + strlen(name) + 2);
    assert_non_null(path);
    sprintf(path, "%s/%s", dir, name);
    for (char *p = path + strlen(dir) + 1; *p; p++) /* name's subdirectories */
        if (*p == '/') {
            *p = '\0';
            mkdir(path, 0777);
            *p = '/';
        }
    helper_write_file(path, text, strlen(text));
    return path;
}

char *cfgt_copy_configs(void)
{
    char *dir = cfgt_mkdir();
    char cmd[256];
    snprintf(cmd, sizeof cmd, "cp -R configs/. '%s'", dir);
    assert_int_equal(system(cmd), 0);
    return dir;
}

sim_status cfgt_load(const char *base, const char *file, int n, const char *const *ovr, cfg_config **out)
{
    const char *files[1] = {file};
    cfg_args a = {base, NULL, files, file ? 1 : 0, ovr, n};
    *out = NULL;
    return cfg_load(&a, out);
}

cfg_config *cfgt_load_ok(const char *base, int n, const char *const *ovr)
{
    cfg_config *cfg;
    if (cfgt_load(base, NULL, n, ovr, &cfg) != SIM_OK)
        fail_msg("loading %s failed: %s", base ? base : "configs/base.yml", sim_errmsg());
    return cfg;
}
