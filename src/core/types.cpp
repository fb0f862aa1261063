// Names, sizes and parsers of the public vocabulary types.
#include "dfss/types.hpp"

#include <charconv>
#include <string>

#include "dfss/attention.hpp"
#include "dfss/error.hpp"

namespace dfss {

std::size_t dtype_size(dtype t) noexcept {
  switch (t) {
    case dtype::f64: return 8;
    case dtype::f32: return 4;
    case dtype::f16: return 2;
    case dtype::bf16: return 2;
    case dtype::i32: return 4;
    case dtype::i64: return 8;
    case dtype::u8: return 1;
    case dtype::u16: return 2;
  }
  return 0;
}

const char* dtype_name(dtype t) noexcept {
  switch (t) {
    case dtype::f64: return "f64";
    case dtype::f32: return "f32";
    case dtype::f16: return "f16";
    case dtype::bf16: return "bf16";
    case dtype::i32: return "i32";
    case dtype::i64: return "i64";
    case dtype::u8: return "u8";
    case dtype::u16: return "u16";
  }
  return "unknown";
}

bool dtype_is_floating(dtype t) noexcept {
  return t == dtype::f64 || t == dtype::f32 || t == dtype::f16 || t == dtype::bf16;
}

namespace {

bool parse_int(std::string_view s, int& out) {
  if (s.empty()) return false;
  const char* end = s.data() + s.size();
  auto [ptr, ec] = std::from_chars(s.data(), end, out);
  return ec == std::errc() && ptr == end;
}

}  // namespace

pattern pattern::parse(std::string_view text, std::string_view argument) {
  if (text == "dense") return pattern{1, 1};
  const auto colon = text.find(':');
  pattern p{0, 0};
  if (colon == std::string_view::npos || !parse_int(text.substr(0, colon), p.n) ||
      !parse_int(text.substr(colon + 1), p.m)) {
    throw error(status_code::invalid_argument,
                "dfss: argument '" + std::string(argument) +
                    "': expected \"N:M\" (e.g. \"2:4\") or \"dense\", got \"" + std::string(text) +
                    "\"");
  }
  if (p.n < 1 || p.m < p.n || p.m > kMaxGroupSize) {
    throw error(status_code::invalid_argument,
                "dfss: argument '" + std::string(argument) + "': expected 1 <= N <= M <= " +
                    std::to_string(kMaxGroupSize) + ", got " + std::string(text));
  }
  return p;
}

std::string pattern::str() const {
  if (is_dense()) return "dense";
  return std::to_string(n) + ":" + std::to_string(m);
}

const char* backend_name(backend b) noexcept {
  switch (b) {
    case backend::automatic: return "automatic";
    case backend::reference: return "reference";
    case backend::cpu: return "cpu";
    case backend::cuda: return "cuda";
  }
  return "unknown";
}

backend parse_backend(std::string_view text, std::string_view argument) {
  for (backend b : {backend::automatic, backend::reference, backend::cpu, backend::cuda}) {
    if (text == backend_name(b)) return b;
  }
  if (text == "auto") return backend::automatic;
  throw error(status_code::invalid_argument,
              "dfss: argument '" + std::string(argument) +
                  "': expected one of automatic, reference, cpu, cuda; got \"" +
                  std::string(text) + "\"");
}

cpu_algorithm parse_cpu_algorithm(std::string_view text, std::string_view argument) {
  if (text == "fused") return cpu_algorithm::fused;
  if (text == "three-stage" || text == "three_stage") return cpu_algorithm::three_stage;
  throw error(status_code::invalid_argument, "dfss: argument '" + std::string(argument) +
                                                 "': expected fused or three-stage, got \"" + std::string(text) + "\"");
}

namespace {
constexpr cpu_isa kAllIsas[] = {cpu_isa::automatic, cpu_isa::generic, cpu_isa::avx2, cpu_isa::portable, cpu_isa::sse4,
                                cpu_isa::avx3,      cpu_isa::neon,    cpu_isa::sve,  cpu_isa::sve2,
                                cpu_isa::avx3_bf16};
}  // namespace

const char* cpu_isa_name(cpu_isa isa) noexcept {
  switch (isa) {
    case cpu_isa::automatic: return "automatic";
    case cpu_isa::generic: return "generic";
    case cpu_isa::avx2: return "avx2";
    case cpu_isa::portable: return "portable";
    case cpu_isa::sse4: return "sse4";
    case cpu_isa::avx3: return "avx3";
    case cpu_isa::neon: return "neon";
    case cpu_isa::sve: return "sve";
    case cpu_isa::sve2: return "sve2";
    case cpu_isa::avx3_bf16: return "avx3_bf16";
  }
  return "unknown";
}

cpu_isa parse_cpu_isa(std::string_view text, std::string_view argument) {
  if (text == "auto") return cpu_isa::automatic;
  for (cpu_isa isa : kAllIsas) {
    if (text == cpu_isa_name(isa)) return isa;
  }
  throw error(status_code::invalid_argument,
              "dfss: argument '" + std::string(argument) +
                  "': expected automatic, generic, portable or a SIMD target (sse4, avx2, avx3, avx3_bf16, neon, sve, sve2), "
                  "got \"" + std::string(text) + "\"");
}

}  // namespace dfss
