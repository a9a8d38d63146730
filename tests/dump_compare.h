/* dump_compare.h — test support: `shardsim dump` against MaxText 0.2.5's own sharding dump of the
 * same configuration (tests/data/maxtext-0.2.5/goldens, made on CPU devices by gen.sh there). */
#ifndef TESTS_DUMP_COMPARE_H
#define TESTS_DUMP_COMPARE_H

/* Runs cli_dump with args (the configuration; output_dir is added) and requires, against the golden
 * directory gdir: every named sharding (mesh axes of size 1 aside) and shape equal, every logical
 * name equal to logical_names.json's (0.2.5's names, no mapping), and no leaf on one side only; the
 * NNX-only leaves (rng streams, optax counts) are skipped.  Prints a line naming `what` and returns
 * the leaves compared.  Any difference fails the test. */
int dump_compare_025(const char *what, const char *gdir, int nargs, const char *const *args);
/* The same against release `rel`'s dump (e.g. "0.2.0": tests/data/maxtext-0.2.0/goldens, whose Linen
 * state names and logical_names.json, written from the Linen logical annotations, compare alike); args
 * should carry maxtext_release=rel. */
int dump_compare_release(const char *rel, const char *what, const char *gdir, int nargs, const char *const *args);

#endif
