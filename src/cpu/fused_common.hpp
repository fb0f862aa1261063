// Constants every fused CPU kernel (the scalar twin and the SIMD family in src/cpu/simd/) shares.
#pragma once

namespace dfss::cpu::fused {

inline constexpr float kLog2e = 1.4426950408889634f;
inline constexpr float kLn2 = 0.6931471805599453f;
/// The backward computes P = exp(scale * s - LSE) straight from the forward's fp32 LSE only while
/// |LSE| <= this. The rounding of LSE and of scale * s puts about eps_f32 |LSE| of relative error
/// into P: up to ~64 eps_f32 here, of the order of the backward's other fp32 errors, while ordinary
/// attention rows (|LSE| a few tens at most) stay on the direct path. Beyond it (large or
/// overflowed scores, docs/semantics.md "Non-finite and extreme inputs") the backward recomputes
/// the row's maximum and sum itself and uses P = exp(scale * (s - max)) / sum.
inline constexpr float kDirectLseLimit = 64.0f;

}  // namespace dfss::cpu::fused
