/* keys.c — `shardsim keys [pattern]`: the key contract (configs/keys.yml) as a
 * table: every key with its class, default and one-line reason.  A pattern
 * selects keys whose name contains it (or matches it as a shell glob when it
 * has * ? or [), or, as class=honoured|inert|refused, one class. */
#include "cli/cli.h"
#include "cli/common.h"

#include <fnmatch.h>
#include <stdlib.h>
#include <string.h>

#include "config/config.h"

static int key_selected(const cfg_entry *e, const char *pattern)
{
    if (!pattern || !*pattern) return 1;
    if (!strncmp(pattern, "class=", 6)) return !strcmp(cfg_key_class_name(e->cls), pattern + 6);
    if (strpbrk(pattern, "*?[")) return fnmatch(pattern, e->key, 0) == 0;
    return strstr(e->key, pattern) != NULL;
}

int cli_keys(int argc, char **argv, FILE *out, FILE *err)
{
    const char *pattern = NULL;
    for (int i = 0; i < argc; i++) {
        if (pattern) {
            fprintf(err, "shardsim keys: one pattern at most (got '%s' and '%s'); usage: shardsim keys [pattern]\n",
                    pattern, argv[i]);
            return 2;
        }
        pattern = argv[i];
    }
    if (pattern && !strncmp(pattern, "class=", 6) && strcmp(pattern + 6, "honoured") && strcmp(pattern + 6, "inert") &&
        strcmp(pattern + 6, "refused")) {
        fprintf(err, "shardsim keys: %s: expected class=honoured, class=inert or class=refused\n", pattern);
        return 2;
    }
    cfg_config *cfg = NULL;
    sim_status st = cfg_load_argv(cli_base_config(), 0, NULL, &cfg);
    if (st) return cli_fail(err, st);
    if (!cfg->keys_file) {
        cfg_free(cfg);
        fprintf(err, "shardsim keys: no keys.yml beside %s; the key contract lives in configs/keys.yml\n",
                cli_base_config());
        return 2;
    }
    int counts[4] = {0}, shown = 0;
    size_t wkey = 3;
    for (int i = 0; i < cfg->n; i++)
        if (key_selected(&cfg->entries[i], pattern) && strlen(cfg->entries[i].key) > wkey)
            wkey = strlen(cfg->entries[i].key);
    fprintf(out, "%-*s  %-8s  %-20s  %s\n", (int)wkey, "key", "class", "default", "what it does / why");
    for (int i = 0; i < cfg->n; i++) {
        const cfg_entry *e = &cfg->entries[i];
        if (!key_selected(e, pattern)) continue;
        counts[e->cls]++;
        shown++;
        char *def = cfg_value_to_text(&e->value, 0);
        if (strlen(def) > 20) strcpy(def + 17, "...");
        const cfg_value *sim = cfg_entry_field(e, "simulated");
        char *simtext = sim ? cfg_value_to_text(sim, 0) : NULL;
        fprintf(out, "%-*s  %-8s  %-20s  %s%s%s%s\n", (int)wkey, e->key, cfg_key_class_name(e->cls), def,
                e->why ? e->why : "", simtext ? " [simulated: " : "", simtext ? simtext : "", simtext ? "]" : "");
        free(def);
        free(simtext);
    }
    fprintf(out, "\n%d key%s: %d honoured, %d inert, %d refused (from %s)\n", shown, shown == 1 ? "" : "s",
            counts[CFG_KEY_HONOURED], counts[CFG_KEY_INERT], counts[CFG_KEY_REFUSED], cfg->keys_file);
    cfg_free(cfg);
    if (!shown && pattern) {
        fprintf(err, "shardsim keys: no key matches '%s'\n", pattern);
        return 2;
    }
    return 0;
}
