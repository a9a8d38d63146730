/* config_fixture.h — test support for config/: scratch directories of YAML files and loads with
 * overrides (on tests/helpers.h's folders and files).  Failures end the test (cmocka). */
#ifndef TESTS_CONFIG_FIXTURE_H
#define TESTS_CONFIG_FIXTURE_H

#include "config/config.h"
#include "tests/helpers.h" /* assert_contains, helper_tmpdir, helper_rm_rf */

/* A new scratch directory (mkdtemp under /tmp), malloc'd; cfgt_rmdir removes it and frees it. */
char *cfgt_mkdir(void);
void cfgt_rmdir(char *dir);
/* Writes text to dir/name (creating name's subdirectories); returns the path, malloc'd. */
char *cfgt_write(const char *dir, const char *name, const char *text);
/* A scratch copy of the project's configs/ (cp -R), malloc'd. */
char *cfgt_copy_configs(void);
/* cfg_load of base (NULL: configs/base.yml) with one extra file (or NULL) and overrides. */
sim_status cfgt_load(const char *base, const char *file, int n, const char *const *ovr, cfg_config **out);
/* The same, failing the test unless it loads. */
cfg_config *cfgt_load_ok(const char *base, int n, const char *const *ovr);

#endif
