// src/cuda/nm_format_device.hpp: internal CUDA launcher that prunes dense fp32 rows to N:M.
//
// The kernel evaluates dfss/format/nm_select.hpp and dfss/format/nm_meta.hpp on the device, so its
// output is bit-identical to dfss::nm_compress followed by dfss::nm_metadata_encode: packed values
// and key indices [rows, ceil(cols/M) * N] and, optionally, row-order 16-bit metadata words
// [rows, nm_meta_words_per_row(cols, format)]. It is the device-side golden compressor for tests
// and the proof that the shared host+device headers compile under nvcc.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "dfss/error.hpp"
#include "dfss/format/nm_meta.hpp"
#include "dfss/types.hpp"

namespace dfss::cuda {

/// @brief Enqueues on @p stream the N:M pruning of the device matrix @p dense ([rows, cols], row
/// stride @p ld >= cols) into device buffers @p values and @p indices ([rows, ceil(cols/M) * N])
/// and, when @p meta_words is not null, row-order metadata words in format @p format (@p p must
/// then be the format's pattern). Returns invalid_argument for bad arguments and cuda_error when
/// the launch fails; never throws and never synchronises with the host.
status nm_prune_rows(const float* dense, std::int64_t rows, std::int64_t cols, std::int64_t ld,
                     pattern p, float* values, std::int32_t* indices, std::uint16_t* meta_words,
                     meta_format format, cudaStream_t stream);

}  // namespace dfss::cuda
