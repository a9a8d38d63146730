/* optim.h — the optimizer table: one row per opt_type (models/core/optimizer.h says what a row
 * holds and what asks it).  Row `name` is `const model_optimizer model_opt_<name>`, defined in
 * models/optimizers/<name>.c; optim.c lists them in model_optimizers, in this order, and opt_type's
 * number (model_optim_cfg.type) is the row's position: MODEL_OPT_<NUMBER>. */
#ifndef MODELS_OPTIM_H
#define MODELS_OPTIM_H

#include "models/core/optimizer.h"

/* X(NUMBER, name) */
#define MODEL_OPTIMIZERS(X)                                                                                            \
    X(ADAMW, adamw)                                                                                                    \
    X(SGD, sgd)                                                                                                        \
    X(MUON, muon)                                                                                                      \
    X(ADAM_PAX, adam_pax)                                                                                              \
    /* one row per line, each ending in a backslash */

#define MODEL_OPT_ENUM_(NUM, name) MODEL_OPT_##NUM,
typedef enum { MODEL_OPTIMIZERS(MODEL_OPT_ENUM_) MODEL_OPT_N } model_opt_type;
#undef MODEL_OPT_ENUM_

#endif
