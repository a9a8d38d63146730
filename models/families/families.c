/* families.c — the family table: one row per simulated decoder_block, in the order MaxText's
 * decoder_block choices are listed to the user.  A new family is one file in models/families/
 * defining its model_family row (models/core/model.h says what each hook does) and one line
 * here. */
#include "models/core/model.h"

extern const model_family model_family_llama2, model_family_deepseek, model_family_qwen3, model_family_mistral,
    model_family_mixtral, model_family_qwen3_moe, model_family_gemma3, model_family_gpt_oss;

const model_family *const model_families[] = {&model_family_llama2,   &model_family_mistral, &model_family_mixtral,
                                              &model_family_deepseek, &model_family_qwen3,   &model_family_qwen3_moe,
                                              &model_family_gemma3,   &model_family_gpt_oss};
const int model_n_families = (int)(sizeof model_families / sizeof model_families[0]);
