/* optim.c — the optimizer table (see optim.h): the rows of MODEL_OPTIMIZERS as the array core
 * reaches them by (model_optimizers, models/core/optimizer.h). */
#include "models/optimizers/optim.h"

#define MODEL_OPT_DECLARE_(NUM, name) extern const model_optimizer model_opt_##name;
MODEL_OPTIMIZERS(MODEL_OPT_DECLARE_)
#undef MODEL_OPT_DECLARE_

#define MODEL_OPT_ROW_(NUM, name) [MODEL_OPT_##NUM] = &model_opt_##name,
const model_optimizer *const model_optimizers[] = {MODEL_OPTIMIZERS(MODEL_OPT_ROW_)};
#undef MODEL_OPT_ROW_
const int model_n_optimizers = MODEL_OPT_N;
