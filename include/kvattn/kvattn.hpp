// Umbrella header: every public kvattn header except the expanded references
// (include "kvattn/reference/..." for those).
#pragma once

#include "kvattn/analysis/budget.hpp"
#include "kvattn/analysis/cache_size.hpp"
#include "kvattn/analysis/dtype.hpp"
#include "kvattn/analysis/params.hpp"
#include "kvattn/attention/gqa.hpp"
#include "kvattn/attention/gqa_config.hpp"
#include "kvattn/cache/gqa_cache.hpp"
#include "kvattn/cache/kv_cache.hpp"
#include "kvattn/cache/token_buffer.hpp"
#include "kvattn/core/errors.hpp"
#include "kvattn/core/mask.hpp"
#include "kvattn/core/random.hpp"
#include "kvattn/core/rms_norm.hpp"
#include "kvattn/core/rope.hpp"
#include "kvattn/core/softmax.hpp"
#include "kvattn/core/types.hpp"
#include "kvattn/version.hpp"
