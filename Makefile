# shardsim build.  Layers are folders; every .c in a layer folder goes into
# libshardsim.a, every tests/test_*.c is one cmocka binary, every bench/*.c
# one benchmark, cli/*.c is the `shardsim` program.
#
#   make            build shardsim, tests and benchmarks
#   make test       build and run every test binary (stops at the first failure)
#   make bench      build and run the benchmarks
#   make asan|ubsan run the tests under AddressSanitizer / UBSan (every binary runs;
#                   the failures are named at the end)
#   make tsan       run the collective tests under ThreadSanitizer (likewise)
#                   (./shardsim always links to build/shardsim; a sanitizer build's program is
#                   build/asan/shardsim, build/ubsan/shardsim)
#   make demo       the README's main job
#   make format     apply .clang-format to every C file

CC      ?= cc
BUILD   ?= build
OPT     ?= -O2
CFLAGS_BASE := -std=c11 $(OPT) -g -D_GNU_SOURCE -I. -pthread \
  -Wall -Wextra -Wpedantic -Wshadow -Wstrict-prototypes -Wmissing-prototypes \
  -Wno-unused-parameter -MMD -MP
ifdef CI
CFLAGS_BASE += -Werror
endif
CFLAGS  := $(CFLAGS_BASE) $(SAN) $(EXTRA_CFLAGS)
LDFLAGS := $(SAN) -pthread
# Every binary links the OpenBLAS kernel selector (blas_kernels/bk_coretype.c): its constructor
# picks and checks the kernels before main, so pull it from the archive even where nothing calls it.
LDFLAGS += -Wl,--undefined=bk_coretype_current
LDLIBS  := -lopenblas -lhwloc -lyaml -ljansson -lm

# Open MPI (or any MPI with a pkg-config file) is optional: found, the program can run under
# `mpirun -np R` (sim/xrank.h); SHARDSIM_MPI=0 builds without it, SHARDSIM_MPI=1 insists on it.
MPI_PC := $(shell pkg-config --exists ompi-c 2>/dev/null && echo ompi-c || \
            (pkg-config --exists mpi-c 2>/dev/null && echo mpi-c))
SHARDSIM_MPI ?= $(if $(MPI_PC),1,0)
ifeq ($(SHARDSIM_MPI),1)
ifeq ($(MPI_PC),)
$(error SHARDSIM_MPI=1 but pkg-config finds neither ompi-c nor mpi-c: install libopenmpi-dev (.ci/install-deps))
endif
CFLAGS  += -DSHARDSIM_MPI $(shell pkg-config --cflags $(MPI_PC))
LDLIBS  += $(shell pkg-config --libs $(MPI_PC))
endif

# models/ is four rooms: core (definition, state, remat, step), blocks (attention, MLA, MLP, MoE),
# families (one file per decoder block) and optimizers.
LAYERS   := blas_kernels sim config mesh models/core models/blocks models/families models/optimizers
LIB_SRC  := $(foreach d,$(LAYERS),$(wildcard $(d)/*.c))
LIB_OBJ  := $(LIB_SRC:%.c=$(BUILD)/%.o)
LIB      := $(BUILD)/libshardsim.a
CLI_SRC  := $(wildcard cli/*.c)
CLI_OBJ  := $(CLI_SRC:%.c=$(BUILD)/%.o)
CLI_LIB_OBJ := $(filter-out $(BUILD)/cli/main.o,$(CLI_OBJ))
BIN      := $(BUILD)/shardsim
TEST_SRC := $(wildcard tests/test_*.c)
TEST_BIN := $(TEST_SRC:tests/%.c=$(BUILD)/tests/%)
TEST_SUPPORT := $(filter-out tests/test_%.c,$(wildcard tests/*.c))
TEST_SUPPORT_OBJ := $(TEST_SUPPORT:%.c=$(BUILD)/%.o)
BENCH_SRC := $(wildcard bench/*.c)
BENCH_BIN := $(BENCH_SRC:bench/%.c=$(BUILD)/bench/%)
BENCH_SUPPORT_OBJ := $(patsubst %.c,$(BUILD)/%.o,$(wildcard bench/lib/*.c))

# Tests run under ThreadSanitizer (the ones with threads and collectives).
TSAN_TESTS ?= test_sim_collectives test_sim_machine test_bk_parallel test_mesh_planmemo test_models_sharedgather

.PHONY: all test bench asan ubsan tsan clean demo install link format

# Objects are kept (not deleted as intermediates), so `make test` rebuilds
# only what changed.
.SECONDARY:

all: $(BIN) link $(TEST_BIN) $(BENCH_BIN)

$(BUILD)/%.o: %.c
	@mkdir -p $(dir $@)
	$(CC) $(CFLAGS) -c $< -o $@

# The kernels' elementwise loops vectorise only when comparisons may be
# evaluated speculatively (no FP traps are used anywhere; IEEE results are
# unchanged), sqrtf need not set errno (one instruction; same results) and
# loops of unknown length may get a vector body plus epilogue.
$(BUILD)/blas_kernels/%.o: CFLAGS += -fno-trapping-math -fno-math-errno -fvect-cost-model=dynamic
# mesh/ and sim/ hold elementwise loops too (RMSNorm, the tape's gradient adds, binary ops, the
# collectives' reductions): without these flags GCC's -O2 'very cheap' cost model leaves them
# scalar (no vector body when the trip count needs an epilogue), AVX-512 clone or not.
$(BUILD)/mesh/%.o $(BUILD)/sim/%.o: CFLAGS += -fno-trapping-math -fno-math-errno -fvect-cost-model=dynamic

# report.html's template is compiled in with the assembler's .incbin, which
# -MMD does not see.
$(BUILD)/cli/report_html.o: cli/report_template.html

$(LIB): $(LIB_OBJ)
	@mkdir -p $(dir $@)
	rm -f $@ && ar rcs $@ $^

$(BIN): $(CLI_OBJ) $(LIB)
	$(CC) $(LDFLAGS) $(CLI_OBJ) $(LIB) $(LDLIBS) -o $@

# ./shardsim names the normal build's program and nothing else.  The sanitizer targets build with
# BUILD=build/asan (ubsan, tsan) and never make this target, so `make asan` cannot turn the everyday
# command into the slow instrumented one: their program is run by its own path (build/asan/shardsim).
# Phony, so `make` also repairs a link left pointing elsewhere.
link: $(BIN)
ifeq ($(BUILD),build)
	@ln -sfn build/shardsim shardsim 2>/dev/null || true
endif

# Tests link the commands too (all of cli/ but main), so they can call them, and the benchmarks'
# support (bench/lib: a configuration's dry run, the stored XLA figures), so they can check them.
$(BUILD)/tests/%: $(BUILD)/tests/%.o $(TEST_SUPPORT_OBJ) $(BENCH_SUPPORT_OBJ) $(CLI_LIB_OBJ) $(LIB)
	$(CC) $(LDFLAGS) $< $(TEST_SUPPORT_OBJ) $(BENCH_SUPPORT_OBJ) $(CLI_LIB_OBJ) $(LIB) $(LDLIBS) -lcmocka -o $@

$(BUILD)/bench/%: $(BUILD)/bench/%.o $(BENCH_SUPPORT_OBJ) $(LIB)
	$(CC) $(LDFLAGS) $< $(BENCH_SUPPORT_OBJ) $(LIB) $(LDLIBS) -o $@

test: $(BIN) link $(TEST_BIN)
	@set -e; pass=0; for t in $(TEST_BIN); do \
	  echo "=== $$t"; $$t; pass=$$((pass+1)); done; \
	echo "all $$pass test binaries passed"

bench: $(BENCH_BIN)
	@set -e; for b in $(BENCH_BIN); do echo "=== $$b"; $$b; done

# The sanitizer targets run every binary of their list and name all that failed at the end (exit 1
# if any did), so one failing binary cannot hide the reports of the ones after it.
# $(call run_all,binaries,environment)
define run_all
@fail=""; pass=0; for t in $(1); do echo "=== $$t"; \
  if $(2) $$t; then pass=$$((pass+1)); else echo "=== FAILED (exit $$?): $$t"; fail="$$fail $$t"; fi; \
done; \
if [ -n "$$fail" ]; then echo "$$pass passed; failed:$$fail"; exit 1; fi; \
echo "all $$pass test binaries passed"
endef

# The sanitizer builds run every 8th case of the bad-input corpus (tests/test_cli_badinput.c).
SAN_TESTS = $(TEST_SRC:tests/%.c=build/$(1)/tests/%)
asan:
	$(MAKE) BUILD=build/asan SAN="-fsanitize=address -fno-omit-frame-pointer" OPT=-O1 build/asan/shardsim \
	  $(call SAN_TESTS,asan)
	$(call run_all,$(call SAN_TESTS,asan),SHARDSIM_CORPUS_SHARE=8)

ubsan:
	$(MAKE) BUILD=build/ubsan SAN="-fsanitize=undefined -fno-sanitize-recover=undefined" OPT=-O1 \
	  build/ubsan/shardsim $(call SAN_TESTS,ubsan)
	$(call run_all,$(call SAN_TESTS,ubsan),SHARDSIM_CORPUS_SHARE=8)

# BK_NO_CLONES: TSan instruments the target_clones resolvers, which the loader runs before TSan
# is set up (every binary crashed at start-up).
tsan:
	$(MAKE) BUILD=build/tsan SAN="-fsanitize=thread -DBK_NO_CLONES" OPT=-O1 $(TSAN_TESTS:%=build/tsan/tests/%)
	$(call run_all,$(TSAN_TESTS:%=build/tsan/tests/%),TSAN_OPTIONS="halt_on_error=1")

demo: $(BIN)
	$(BIN) demo

# make install PREFIX=/usr/local: the program in $(PREFIX)/bin, its data
# (configs/) in $(PREFIX)/share/shardsim/configs, where the program looks
# for it beside its own directory (SHARDSIM_CONFIGS overrides).
PREFIX ?= /usr/local
install: $(BIN)
	install -d $(DESTDIR)$(PREFIX)/bin $(DESTDIR)$(PREFIX)/share/shardsim
	install -m 755 $(BIN) $(DESTDIR)$(PREFIX)/bin/shardsim
	rm -rf $(DESTDIR)$(PREFIX)/share/shardsim/configs
	cp -R configs $(DESTDIR)$(PREFIX)/share/shardsim/configs

clean:
	rm -rf build shardsim

-include $(shell find $(BUILD) -name '*.d' 2>/dev/null)

# One style for every C file, from the checked-in .clang-format (clang-format is not needed to build).
format:
	clang-format -i $(shell find blas_kernels sim config mesh models cli tests bench -name '*.[ch]')
