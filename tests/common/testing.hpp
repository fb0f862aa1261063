// Shared test helpers: problem descriptions, input generators, an independent naive DFSS
// implementation (the second formulation the reference is checked against), and the tolerance
// policy. Every generator draws from a seed printed on failure, so a failing case can be replayed.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "dfss/dfss.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace dfss::testing {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// A seed that differs between runs (fresh inputs every time) unless DFSS_TEST_SEED is set.
inline std::uint64_t test_seed() {
  static const std::uint64_t seed = [] {
    if (const char* e = std::getenv("DFSS_TEST_SEED")) return static_cast<std::uint64_t>(std::stoull(e));
    std::random_device rd;
    return static_cast<std::uint64_t>(rd()) << 32 | rd();
  }();
  return seed;
}

/// One attention problem; tensors are held in fp64 and converted to the tested type on demand.
struct problem {
  std::int64_t B = 1, Lq = 1, Lk = 1, H = 1, Hkv = 1, d = 1;
  pattern pat{2, 4};
  bool causal = false;
  double scale = 0.0;             // 0: default 1/sqrt(d)
  bool bias_b = false, bias_h = false;  // bias present with a real batch / head dimension
  bool has_bias = false;
  std::vector<std::int64_t> key_lengths;  // empty: none (global positions, like the API's)
  std::int64_t key_offset = 0;             // global position of key 0
  std::vector<std::int64_t> query_offset;  // empty: default (key_offset + Lk - Lq)
  std::int64_t sink = 0, recent = 0;       // sink_tokens, recent_tokens
  std::vector<double> q, k, v, bias, dout;
  std::vector<double> dlse;                // empty: no LSE gradient (backward); else [B, H, Lq]

  std::int64_t q_numel() const { return B * Lq * H * d; }
  std::int64_t kv_numel() const { return B * Lk * Hkv * d; }
  std::int64_t bias_numel() const { return (bias_b ? B : 1) * (bias_h ? H : 1) * Lq * Lk; }
  double resolved_scale() const { return scale > 0 ? scale : 1.0 / std::sqrt(static_cast<double>(d)); }

  std::string describe() const {
    std::ostringstream s;
    s << "B=" << B << " Lq=" << Lq << " Lk=" << Lk << " H=" << H << " Hkv=" << Hkv << " d=" << d
      << " pattern=" << pat.str() << " causal=" << causal << " bias=" << has_bias
      << (has_bias ? (std::string("[") + (bias_b ? "B" : "1") + "," + (bias_h ? "H" : "1") + "]") : "")
      << " lens=";
    for (auto l : key_lengths) s << l << ',';
    if (key_offset != 0) s << " key_offset=" << key_offset;
    if (!query_offset.empty()) {
      s << " query_offset=";
      for (auto o : query_offset) s << o << ',';
    }
    if (sink != 0 || recent != 0) s << " sink=" << sink << " recent=" << recent;
    if (!dlse.empty()) s << " dlse";
    s << " seed=" << test_seed();
    return s.str();
  }
};

/// Fills the problem's tensors: uniform reals in [-1, 1) or, with @p integers, small integers in
/// [-3, 3] (scores are then exact in fp32 and fp16 arithmetic, so selection is reproducible).
inline void fill(problem& pr, std::mt19937_64& rng, bool integers = false) {
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::uniform_int_distribution<int> ui(-3, 3);
  auto gen = [&](std::vector<double>& x, std::int64_t n) {
    x.resize(static_cast<std::size_t>(n));
    for (auto& e : x) e = integers ? ui(rng) : u(rng);
  };
  gen(pr.q, pr.q_numel());
  gen(pr.k, pr.kv_numel());
  gen(pr.v, pr.kv_numel());
  gen(pr.dout, pr.q_numel());
  if (pr.has_bias) {
    gen(pr.bias, pr.bias_numel());
    // Some -inf entries: they must behave exactly like masked keys.
    std::uniform_int_distribution<int> pick(0, 6);
    for (auto& e : pr.bias)
      if (pick(rng) == 0) e = -kInf;
  }
}

/// Keys and values [k0, k1) of @p pr (a key shard): sets @p part's Lk, k and v; the rest as it was.
inline void take_keys(problem& part, const problem& pr, std::int64_t k0, std::int64_t k1) {
  part.Lk = k1 - k0;
  const std::int64_t row = pr.Hkv * pr.d;
  part.k.clear(), part.v.clear();
  for (std::int64_t b = 0; b < pr.B; ++b) {
    const auto first = static_cast<std::ptrdiff_t>((b * pr.Lk + k0) * row), last = static_cast<std::ptrdiff_t>((b * pr.Lk + k1) * row);
    part.k.insert(part.k.end(), pr.k.begin() + first, pr.k.begin() + last);
    part.v.insert(part.v.end(), pr.v.begin() + first, pr.v.begin() + last);
  }
}

/// Converts fp64 data to storage type T (round to nearest even).
template <typename T>
std::vector<T> convert(const std::vector<double>& x) {
  std::vector<T> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = from_double<T>(x[i]);
  return out;
}

template <typename T>
std::vector<double> widen(const std::vector<T>& x) {
  std::vector<double> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = to_double(x[i]);
  return out;
}

/// Rounds every element through storage type T, so an fp64 oracle sees exactly the tested inputs.
template <typename T>
std::vector<double> round_through(const std::vector<double>& x) {
  return widen(convert<T>(x));
}

/// Result of the naive implementation: O [B, Lq, H, d], LSE [B, H, Lq], keep [B, H, Lq, Lk].
struct naive_result {
  std::vector<double> o, lse;
  std::vector<unsigned char> keep;
};

/// An independent, literal implementation of docs/semantics.md for packed [B, L, H, d] fp64 data:
/// materialises the masked score matrix and selects by sorting each group's indices (value
/// descending, NaN first, ties to the lower index). It shares no code with the library.
inline naive_result naive_forward(const problem& pr) {
  naive_result r;
  const auto B = pr.B, Lq = pr.Lq, Lk = pr.Lk, H = pr.H, d = pr.d;
  const std::int64_t M = pr.pat.m, N = pr.pat.n;
  r.o.assign(static_cast<std::size_t>(B * Lq * H * d), 0.0);
  r.lse.assign(static_cast<std::size_t>(B * H * Lq), 0.0);
  r.keep.assign(static_cast<std::size_t>(B * H * Lq * Lk), 0);
  const double scale = pr.resolved_scale();
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t h = 0; h < H; ++h) {
      const std::int64_t hk = h / (H / pr.Hkv);
      for (std::int64_t i = 0; i < Lq; ++i) {
        const std::int64_t qpos = pr.query_offset.empty() ? pr.key_offset + Lk - Lq + i
                                                           : pr.query_offset[static_cast<std::size_t>(b)] + i;
        const std::int64_t len =
            pr.key_lengths.empty() ? pr.key_offset + Lk : pr.key_lengths[static_cast<std::size_t>(b)];
        std::vector<double> s(static_cast<std::size_t>(Lk));
        for (std::int64_t j = 0; j < Lk; ++j) {
          double acc = 0;
          for (std::int64_t c = 0; c < d; ++c)
            acc += pr.q[static_cast<std::size_t>(((b * Lq + i) * H + h) * d + c)] *
                   pr.k[static_cast<std::size_t>(((b * Lk + j) * pr.Hkv + hk) * d + c)];
          if (pr.has_bias) {
            const std::int64_t bb = pr.bias_b ? b : 0, hb = pr.bias_h ? h : 0;
            acc += pr.bias[static_cast<std::size_t>(((bb * (pr.bias_h ? H : 1) + hb) * Lq + i) * Lk + j)];
          }
          // Positions are global: key j sits at key_offset + j, query row i at query_offset[b] + i.
          const std::int64_t pos = pr.key_offset + j;
          const bool pad = pos >= len;
          const bool fut = pr.causal && pos > qpos;
          s[static_cast<std::size_t>(j)] = (pad || fut) ? -kInf : acc;
        }
        std::vector<unsigned char> keep(static_cast<std::size_t>(Lk), 0);
        // The row's last visible key (global), -1 when it sees none.
        const std::int64_t last = std::min(len - 1, pr.causal ? qpos : len - 1);
        for (std::int64_t g = 0; g < Lk; g += M) {
          // Sink and recent windows: a group (M global positions) touching either is kept whole.
          bool whole = false;
          for (std::int64_t x = pr.key_offset + g; x < pr.key_offset + g + M; ++x) {
            whole = whole || x < pr.sink || (pr.recent > 0 && last >= 0 && x <= last && x > last - pr.recent);
          }
          if (whole) {
            for (std::int64_t j = g; j < std::min(g + M, Lk); ++j) keep[static_cast<std::size_t>(j)] = 1;
            continue;
          }
          std::vector<std::int64_t> idx;
          for (std::int64_t j = g; j < std::min(g + M, Lk); ++j) idx.push_back(j);
          std::stable_sort(idx.begin(), idx.end(), [&](std::int64_t a, std::int64_t c) {
            const double x = s[static_cast<std::size_t>(a)], y = s[static_cast<std::size_t>(c)];
            if (std::isnan(x) != std::isnan(y)) return std::isnan(x);
            return x > y;
          });
          for (std::int64_t t = 0; t < std::min<std::int64_t>(N, static_cast<std::int64_t>(idx.size())); ++t)
            keep[static_cast<std::size_t>(idx[static_cast<std::size_t>(t)])] = 1;
        }
        // Softmax as float64 computes it: a NaN kept score makes the row NaN; a +inf one gives
        // exp(inf - inf) = NaN. The exponent is scale * (s - max), never scale * s - scale * max,
        // which would lose everything to cancellation once scale * max is large.
        double mx = -kInf;
        bool row_nan = false;
        for (std::int64_t j = 0; j < Lk; ++j) {
          if (!keep[static_cast<std::size_t>(j)]) continue;
          const double sj = s[static_cast<std::size_t>(j)];
          if (std::isnan(sj)) row_nan = true;
          else mx = std::max(mx, sj);
        }
        const std::size_t orow = static_cast<std::size_t>(((b * Lq + i) * H + h) * d);
        const std::size_t lrow = static_cast<std::size_t>((b * H + h) * Lq + i);
        for (std::int64_t j = 0; j < Lk; ++j)
          r.keep[static_cast<std::size_t>(((b * H + h) * Lq + i) * Lk + j)] = keep[static_cast<std::size_t>(j)];
        if (row_nan) {
          r.lse[lrow] = kNaN;
          for (std::int64_t c = 0; c < d; ++c) r.o[orow + static_cast<std::size_t>(c)] = kNaN;
          continue;
        }
        if (mx == -kInf) {
          r.lse[lrow] = -kInf;
          continue;
        }
        std::vector<double> p(static_cast<std::size_t>(Lk), 0.0);
        double sum = 0;
        for (std::int64_t j = 0; j < Lk; ++j)
          if (keep[static_cast<std::size_t>(j)]) {
            p[static_cast<std::size_t>(j)] = std::exp(scale * (s[static_cast<std::size_t>(j)] - mx));
            sum += p[static_cast<std::size_t>(j)];
          }
        r.lse[lrow] = scale * mx + std::log(sum);
        // Keys that are pruned or masked (P = 0 from a -inf score) are skipped, not multiplied by 0
        // (docs/design.md): a NaN in their value rows never reaches the output.
        for (std::int64_t j = 0; j < Lk; ++j) {
          if (!keep[static_cast<std::size_t>(j)] || s[static_cast<std::size_t>(j)] == -kInf) continue;
          for (std::int64_t c = 0; c < d; ++c)
            r.o[orow + static_cast<std::size_t>(c)] +=
                p[static_cast<std::size_t>(j)] / sum *
                pr.v[static_cast<std::size_t>(((b * Lk + j) * pr.Hkv + hk) * d + c)];
        }
      }
    }
  return r;
}

/// Whether this CPU reports every feature in @p names (as dfss::get_build_info lists them).
inline bool cpu_has(std::initializer_list<const char*> names) {
  const auto f = get_build_info().cpu_features;
  for (const char* n : names)
    if (std::find(f.begin(), f.end(), n) == f.end()) return false;
  return true;
}

// ---- The CPU kernels to test: one list, fed by the library's list of compiled SIMD targets ------

/// The fused CPU kernels every ISA-iterating test runs: the generic scalar twin, portable (the
/// baseline SIMD target under its alias), then every SIMD target this build compiled (best first),
/// whether or not this CPU runs it: a test skips those with cpu_isa_skip_reason.
inline std::vector<cpu_isa> fused_cpu_isas() {
  std::vector<cpu_isa> out{cpu_isa::generic, cpu_isa::portable};
  for (const cpu_isa_support& t : cpu_simd_isas()) out.push_back(t.isa);
  return out;
}

/// Why a test of @p isa cannot run on this machine (this CPU lacks the target), or "" when it can.
inline std::string cpu_isa_skip_reason(cpu_isa isa) {
  if (isa == cpu_isa::generic) return "";
  std::vector<cpu_isa_support> all = cpu_simd_isas();
  if (all.empty()) return std::string("this build has no SIMD kernels, so no ") + cpu_isa_name(isa);
  if (isa == cpu_isa::portable) isa = all.back().isa;  // the baseline target: the last (worst) one
  for (const cpu_isa_support& t : all) {
    if (t.isa == isa) return t.supported ? "" : std::string("this CPU cannot run the ") + cpu_isa_name(isa) + " target";
  }
  return std::string("this build did not compile the ") + cpu_isa_name(isa) + " target";
}

/// The fused CPU kernels of fused_cpu_isas that this machine runs (for loops inside one test).
inline std::vector<cpu_isa> runnable_cpu_isas() {
  std::vector<cpu_isa> out;
  for (cpu_isa isa : fused_cpu_isas()) {
    if (cpu_isa_skip_reason(isa).empty()) out.push_back(isa);
  }
  return out;
}

/// A test-name fragment for @p isa: "Generic", "Portable", "Avx2", "Sse4", "Avx3", ...
inline std::string cpu_isa_label(cpu_isa isa) {
  std::string s = cpu_isa_name(isa);
  if (!s.empty()) s[0] = static_cast<char>(s[0] - 'a' + 'A');
  return s;
}

/// The target cpu_isa::automatic runs on this machine, by the tests' own rule: the first runnable
/// SIMD target, except avx3_bf16 on an Intel CPU (its bf16 dot products are slower than fp32 FMAs
/// there: the next target, avx3) unless DFSS_CPU_BF16_DOT = 0 or 1 says otherwise; generic when
/// no SIMD target runs.
inline cpu_isa automatic_cpu_isa() {
  for (const cpu_isa_support& t : cpu_simd_isas()) {
    if (!t.supported) continue;
    if (t.isa != cpu_isa::avx3_bf16) return t.isa;
    bool fast = true;
    const char* forced = std::getenv("DFSS_CPU_BF16_DOT");
    if (forced != nullptr && (forced[0] == '0' || forced[0] == '1') && forced[1] == '\0') {
      fast = forced[0] == '1';
    } else {
#if defined(__x86_64__) || defined(__i386__)
      unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
      __get_cpuid(0, &eax, &ebx, &ecx, &edx);
      char vendor[12];
      std::memcpy(vendor, &ebx, 4);
      std::memcpy(vendor + 4, &edx, 4);
      std::memcpy(vendor + 8, &ecx, 4);
      fast = std::string(vendor, 12) != "GenuineIntel";
#endif
    }
    if (fast) return t.isa;
  }
  return cpu_isa::generic;
}

/// Whether the avx3 forward runs bf16 inputs on AMX tiles in this process, by the test's own
/// reading of the CPU: cpuid's AMX-TILE and AMX-BF16 (leaf 7, EDX bits 24 and 22), unless
/// DFSS_CPU_AMX is 0 (core::cpu_uses_amx; a build whose compiler lacks the flags has no AMX path,
/// which this does not see).
inline bool avx3_scores_on_amx() {
  const char* forced = std::getenv("DFSS_CPU_AMX");
  if (forced != nullptr && forced[0] == '0' && forced[1] == '\0') return false;
#if defined(__x86_64__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return false;
  return (edx & (1u << 24)) != 0 && (edx & (1u << 22)) != 0;
#else
  return false;
#endif
}

/// Whether the forward on @p isa rounds P to bf16 for @p t inputs: the avx3_bf16 target's bf16 dot
/// products (docs/semantics.md, "Precision"), which automatic picks where the CPU runs them fast,
/// and the avx3 forward's P V on AMX tiles.
inline bool forward_rounds_p_to_bf16(cpu_isa isa, dtype t) {
  if (t != dtype::bf16) return false;
  const cpu_isa runs = isa == cpu_isa::automatic ? automatic_cpu_isa() : isa;
  return runs == cpu_isa::avx3_bf16 || (runs == cpu_isa::avx3 && avx3_scores_on_amx());
}

/// The unit roundoff of bf16 (8 significant bits): round to nearest moves a value by at most
/// 2^-8 of itself. A forward that rounds each softmax weight p_j to bf16 (forward_rounds_p_to_bf16)
/// and divides by the fp32 sum of the unrounded weights moves O by |sum_j (p~_j - p_j) v_j| / sum_j
/// p_j <= 2^-8 sum_j p_j |v_j| / sum_j p_j <= 2^-8 max|v| on top of the fp32 bound; the LSE (from
/// the unrounded sum) does not change.
inline constexpr double kBf16Roundoff = 1.0 / 256;

/// The kernel name the selector reports for @p isa (forward or backward), as scripts know them.
inline std::string fused_kernel_name(cpu_isa isa, bool forward) {
  const std::string dir = forward ? "cpu.fused_forward." : "cpu.fused_backward.";
  return dir + (isa == cpu_isa::generic ? "scalar" : cpu_isa_name(isa));
}

/// Score q_i . k_j (+ bias) of (batch b, head h) in fp64, before masks; packed [B, L, H, d] data.
inline double score(const problem& pr, std::int64_t b, std::int64_t h, std::int64_t i, std::int64_t j) {
  double acc = 0;
  const std::int64_t hk = h / (pr.H / pr.Hkv);
  for (std::int64_t c = 0; c < pr.d; ++c)
    acc += pr.q[static_cast<std::size_t>(((b * pr.Lq + i) * pr.H + h) * pr.d + c)] *
           pr.k[static_cast<std::size_t>(((b * pr.Lk + j) * pr.Hkv + hk) * pr.d + c)];
  if (pr.has_bias) {
    const std::int64_t bb = pr.bias_b ? b : 0, hb = pr.bias_h ? h : 0;
    acc += pr.bias[static_cast<std::size_t>(((bb * (pr.bias_h ? pr.H : 1) + hb) * pr.Lq + i) * pr.Lk + j)];
  }
  return acc;
}

/// Smallest gap, over every group of every row, between the N-th and (N+1)-th largest finite scores
/// (masks not applied), per row [B, Lq, H] order. A selection can only flip where the gap is small.
inline std::vector<double> selection_gaps(const problem& pr) {
  std::vector<double> gaps(static_cast<std::size_t>(pr.B * pr.Lq * pr.H), kInf);
  for (std::int64_t b = 0; b < pr.B; ++b)
    for (std::int64_t h = 0; h < pr.H; ++h)
      for (std::int64_t i = 0; i < pr.Lq; ++i)
        for (std::int64_t g = 0; g < pr.Lk; g += pr.pat.m) {
          std::vector<double> s;
          for (std::int64_t j = g; j < std::min(g + pr.pat.m, pr.Lk); ++j) {
            const double x = score(pr, b, h, i, j);
            if (std::isfinite(x)) s.push_back(x);
          }
          std::sort(s.rbegin(), s.rend());
          if (static_cast<std::int64_t>(s.size()) > pr.pat.n) {
            double& gap = gaps[static_cast<std::size_t>((b * pr.Lq + i) * pr.H + h)];
            gap = std::min(gap, s[static_cast<std::size_t>(pr.pat.n - 1)] - s[static_cast<std::size_t>(pr.pat.n)]);
          }
        }
  return gaps;
}

/// Rows in which some group's N-th and (N+1)-th largest scores lie within @p bound: there an fp32
/// kernel may legitimately keep a different key than the fp64 reference.
inline std::vector<bool> near_tie_rows(const problem& pr, double bound) {
  const auto gaps = selection_gaps(pr);
  std::vector<bool> rows(gaps.size());
  for (std::size_t r = 0; r < gaps.size(); ++r) rows[r] = gaps[r] < bound;
  return rows;
}

/// @brief Whether every output row that is not a near tie (@p ties, from near_tie_rows: O rows in
/// [B, Lq, H] order, @p d values each) matches @p want within @p tol; near-tie rows are skipped and
/// counted in @p skipped. The failure names the first row and column off, with both values.
inline ::testing::AssertionResult rows_near_except_ties(const std::vector<double>& got, const std::vector<double>& want,
                                                        const std::vector<bool>& ties, std::int64_t d, double tol,
                                                        std::size_t* skipped = nullptr) {
  if (got.size() != want.size() || want.size() != ties.size() * static_cast<std::size_t>(d)) {
    return ::testing::AssertionFailure() << "sizes: got " << got.size() << ", want " << want.size() << ", "
                                         << ties.size() << " rows of " << d;
  }
  std::size_t n = 0;
  for (std::size_t r = 0; r < ties.size(); ++r) {
    if (ties[r]) {
      ++n;
      continue;
    }
    for (std::int64_t c = 0; c < d; ++c) {
      const std::size_t x = r * static_cast<std::size_t>(d) + static_cast<std::size_t>(c);
      if (!(std::abs(got[x] - want[x]) <= tol)) {
        return ::testing::AssertionFailure() << "row " << r << " column " << c << ": got " << got[x] << ", want "
                                             << want[x] << " (tolerance " << tol << ")";
      }
    }
  }
  if (skipped != nullptr) *skipped = n;
  return ::testing::AssertionSuccess();
}

/// Largest |a - b| / (1 + |b|) over finite pairs; a NaN or infinity mismatch (in position or sign)
/// counts as infinity, so non-finite values are compared, never skipped; so do vectors of different
/// sizes (a missing output must not pass as a perfect match).
inline double max_rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  if (a.size() != b.size()) return kInf;
  double e = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      if (std::isnan(a[i]) != std::isnan(b[i])) return kInf;
      continue;
    }
    if (std::isinf(a[i]) || std::isinf(b[i])) {
      if (a[i] != b[i]) return kInf;
      continue;
    }
    e = std::max(e, std::abs(a[i] - b[i]) / (1.0 + std::abs(b[i])));
  }
  return e;
}

}  // namespace dfss::testing
