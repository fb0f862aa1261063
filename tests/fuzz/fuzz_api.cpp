// Fuzz target: argument validation and dispatch of dfss::attention_forward and
// dfss::attention_backward (and dfss::select_kernel, the validator they share).
//
// The input is decoded (FuzzedDataProvider) into one call: shapes (B, H, Hkv, Lq, Lk, d mostly small,
// sometimes 0, negative or huge), per tensor an element type (including integer types and codes
// outside the enumeration), a claimed rank, a layout (packed, permuted, padded, broadcast, negative,
// arbitrary or huge strides) and a placement (its own buffer, or inside another tensor's buffer:
// aliasing inputs, outputs overlapping inputs or each other, misaligned), the pattern (including
// invalid N:M), causal, bias, key lengths (i32 or i64, in and out of range), scale (0, ordinary,
// negative, NaN, inf, huge, denormal), num_threads (small, 0, negative, huge), backend, cpu_isa,
// cpu_algorithm and the direction. Every buffer is allocated with exactly the bytes its views span,
// so that AddressSanitizer reports any access outside them; values are small integers (plus, when
// the input asks, NaN and infinities), so every score is exact in fp32 and the N:M selection of a
// correct kernel equals the reference's exactly.
//
// Contract checked for every input:
//  - the call returns or throws dfss::error with code invalid_argument or unsupported (internal is a
//    bug by the API's own definition; any other exception, crash or sanitizer report is a finding);
//  - select_kernel agrees with the call (it throws with the same code when the call is invalid,
//    answers "unsupported" when the call throws unsupported, and "supported" when it runs);
//  - arguments that are invalid by the documented contract are rejected (wrong rank, unknown element
//    type, non-float q, mismatched k/v types, negative sizes, d = 0, invalid N:M, scale negative,
//    NaN, inf, or (for non-f64 inputs) non-zero outside [FLT_MIN, FLT_MAX], num_threads < 0 or
//    > 1024, key lengths outside [0, Lk], Lk > INT32_MAX, compressed outputs outside the cpu three-stage kernel);
//  - a call that succeeds matches the fp64 reference (backend::reference on packed f64 copies of the
//    same values) within the tolerances below, and writes nothing outside its outputs' elements;
//  - a call that fails changes nothing outside its outputs' elements either.
// Work is bounded: problems larger than kMaxWork multiply-adds, or with a tensor too large to
// allocate or fill, only go through select_kernel (validation without computing).
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <optional>
#include <sstream>
#include <string>
#include <vector>

#include "dfss/dfss.hpp"

namespace {

using dfss::dtype;
using i64 = std::int64_t;
using u64 = std::uint64_t;

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kFloatMax = static_cast<double>(std::numeric_limits<float>::max());
constexpr double kFloatMin = static_cast<double>(std::numeric_limits<float>::min());

// Multiply-adds of Q K^T (B * H * Lq * Lk * d) above which a call is only validated: the fp64
// reference, the kernel and the backward then stay around a millisecond per input under ASan.
constexpr i64 kMaxWork = 20000;
// Elements of one tensor the harness fills, reads back and compares (the largest in-bound
// problem, 4 x 9 x 17 x 12, has fewer; beyond it the call is validated only).
constexpr i64 kMaxElements = 1 << 14;
// Bytes of one buffer the harness allocates; views spanning more are validated only.
constexpr i64 kMaxBytes = 1 << 18;
// Key lengths that validation may read when only validating (it reads one per batch).
constexpr i64 kMaxLengthsRead = 1 << 12;
// The documented cap on num_threads.
constexpr int kMaxThreads = 1024;

enum slot : int { Q, K, V, OUT, LSE, BIAS, LENS, DOUT, DQ, DK, DV, DBIAS, CVALS, CIDX, CMETA, kSlots };
constexpr const char* kSlotName[kSlots] = {"q",
                                           "k",
                                           "v",
                                           "out",
                                           "lse",
                                           "bias",
                                           "key_lengths",
                                           "dout",
                                           "dq",
                                           "dk",
                                           "dv",
                                           "dbias",
                                           "compressed_values",
                                           "compressed_indices",
                                           "compressed_meta"};

[[noreturn]] void finding(const std::string& what, const std::string& description) {
  std::fprintf(stderr, "fuzz_api: %s\n%s\n", what.c_str(), description.c_str());
  std::abort();
}

bool is_float(dtype t) { return t == dtype::f64 || t == dtype::f32 || t == dtype::f16 || t == dtype::bf16; }
bool is_16bit(dtype t) { return t == dtype::f16 || t == dtype::bf16; }
bool known(dtype t) { return dfss::dtype_size(t) != 0; }
std::size_t item(dtype t) { return std::max<std::size_t>(1, dfss::dtype_size(t)); }

std::string type_str(dtype t) { return known(t) ? dfss::dtype_name(t) : "code " + std::to_string(static_cast<int>(t)); }

/// Wrapping arithmetic for strides derived from huge shapes (the views may be nonsense; only the
/// validation has to make sense of them).
i64 wrap_mul(i64 a, i64 b) { return static_cast<i64>(static_cast<u64>(a) * static_cast<u64>(b)); }
i64 wrap_add(i64 a, i64 b) { return static_cast<i64>(static_cast<u64>(a) + static_cast<u64>(b)); }
i64 sat_add(i64 a, i64 b) {
  i64 r;
  return __builtin_add_overflow(a, b, &r) ? (b > 0 ? INT64_MAX : INT64_MIN) : r;
}

/// Element values: a splitmix64 stream seeded from the input, so that a few input bytes fill any
/// number of elements reproducibly.
struct rng {
  u64 s;
  u64 next() {
    u64 z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
  }
  int small() { return static_cast<int>(next() % 7) - 3; }  // [-3, 3]
};

template <class T>
T get(const std::uint8_t* e) {
  T x;
  std::memcpy(&x, e, sizeof x);
  return x;
}

template <class T>
void put(std::uint8_t* e, T x) {
  std::memcpy(e, &x, sizeof x);
}

/// Element @p off (in elements) of @p p, of type @p t, as a double (exact for every type but i64).
double load(const std::uint8_t* p, dtype t, i64 off) {
  const std::uint8_t* e = p + off * static_cast<i64>(item(t));
  switch (t) {
    case dtype::f64: return get<double>(e);
    case dtype::f32: return static_cast<double>(get<float>(e));
    case dtype::f16: return static_cast<double>(dfss::f16_to_float(get<std::uint16_t>(e)));
    case dtype::bf16: return static_cast<double>(dfss::bf16_to_float(get<std::uint16_t>(e)));
    case dtype::i32: return get<std::int32_t>(e);
    case dtype::i64: return static_cast<double>(get<i64>(e));
    case dtype::u8: return *e;
    case dtype::u16: return get<std::uint16_t>(e);
  }
  return *e;
}

/// @p x as an integer for the integer types (NaN as 0, the rest clamped then wrapped to the type).
i64 as_int(double x) { return std::isnan(x) ? 0 : static_cast<i64>(std::clamp(x, -0x1p62, 0x1p62)); }

/// A key length as stored (exact for i32 and i64; another type, which the API refuses for key
/// lengths, through as_int: a NaN or huge value there must not make the harness itself undefined).
i64 load_int(const std::uint8_t* p, dtype t, i64 off) {
  const std::uint8_t* e = p + off * static_cast<i64>(item(t));
  if (t == dtype::i32) return get<std::int32_t>(e);
  if (t == dtype::i64) return get<i64>(e);
  return as_int(load(p, t, off));
}

/// Stores @p x; the float types round it, the integer types take as_int(x) modulo their range.
void store(std::uint8_t* p, dtype t, i64 off, double x) {
  std::uint8_t* e = p + off * static_cast<i64>(item(t));
  switch (t) {
    case dtype::f64: return put(e, x);
    case dtype::f32: return put(e, static_cast<float>(x));
    case dtype::f16: return put(e, dfss::float_to_f16(static_cast<float>(x)));
    case dtype::bf16: return put(e, dfss::float_to_bf16(static_cast<float>(x)));
    case dtype::i32: return put(e, static_cast<std::int32_t>(as_int(x)));
    case dtype::i64: return put(e, as_int(x));
    case dtype::u8: return put(e, static_cast<std::uint8_t>(as_int(x)));
    case dtype::u16: return put(e, static_cast<std::uint16_t>(as_int(x)));
  }
  *e = static_cast<std::uint8_t>(as_int(x));
}

/// Stores a key length; i32 storage saturates it to the int32 range.
void store_int(std::uint8_t* p, dtype t, i64 off, i64 x) {
  std::uint8_t* e = p + off * static_cast<i64>(item(t));
  if (t == dtype::i64) return put(e, x);
  if (t == dtype::i32) return put(e, static_cast<std::int32_t>(std::clamp<i64>(x, INT32_MIN, INT32_MAX)));
  store(p, t, off, static_cast<double>(std::clamp<i64>(x, -3, 3)));
}

/// One tensor argument as the harness lays it out.
struct tensor {
  bool present = false;
  dtype type = dtype::f32;
  int dims = 0;        ///< its real number of dimensions (4, 3 for lse, 1 for key_lengths)
  int rank_claim = 0;  ///< the rank written into the view (usually dims)
  std::array<i64, 4> shape{}, stride{};
  bool null_data = false;
  int share = -1;       ///< slot whose buffer this tensor lives in (-1: its own buffer)
  i64 share_bytes = 0;  ///< byte offset of its element 0 from that slot's element 0
  // Derived.
  i64 count = 0;  ///< elements (0 when a dimension is <= 0; saturated when huge)
  bool allocatable = true;
  i64 lo = 0, hi = 0;  ///< bytes spanned relative to element 0: [lo, hi)
  int arena = -1;
  i64 pos = 0;  ///< byte position of element 0 in its arena
  std::uint8_t* data = nullptr;

  /// Offset (elements) of the @p n-th element in row-major logical order.
  i64 offset(i64 n) const {
    i64 off = 0;
    for (int d = dims - 1; d >= 0; --d) {
      off += (n % shape[d]) * stride[d];
      n /= shape[d];
    }
    return off;
  }
};

void derive_extent(tensor& t) {
  t.count = 1;
  bool empty = false;
  for (int d = 0; d < t.dims; ++d) {
    if (t.shape[d] <= 0)
      empty = true;
    else if (__builtin_mul_overflow(t.count, t.shape[d], &t.count))
      t.count = INT64_MAX;
  }
  if (empty) t.count = 0;
  i64 min_off = 0, max_off = 0;
  bool overflow = false;
  for (int d = 0; d < t.dims && !empty; ++d) {
    i64 span = 0;
    overflow = overflow || __builtin_mul_overflow(t.shape[d] - 1, t.stride[d], &span);
    overflow = overflow || __builtin_add_overflow(span < 0 ? min_off : max_off, span, span < 0 ? &min_off : &max_off);
  }
  const auto es = static_cast<i64>(item(t.type));
  i64 bytes = 0;
  overflow = overflow || __builtin_sub_overflow(max_off, min_off, &bytes) || __builtin_add_overflow(bytes, 1, &bytes) ||
             __builtin_mul_overflow(bytes, es, &bytes);
  t.allocatable = empty || (!overflow && bytes <= kMaxBytes);
  if (empty || !t.allocatable) {
    t.lo = 0;
    t.hi = empty ? 0 : es;  // an unallocatable view gets one element: it is only validated
  } else {
    t.lo = min_off * es;
    t.hi = (max_off + 1) * es;
  }
}

struct decoded {
  bool backward = false;
  i64 B = 1, H = 1, Hkv = 1, Lq = 1, Lk = 1, d = 1;
  dfss::attention_config cfg;
  bool specials = false;
  bool lens_invalid = false;
  u64 seed = 0;
  std::array<tensor, kSlots> t;
};

i64 special_size(FuzzedDataProvider& f) {
  static constexpr i64 kSizes[] = {-1,           -7,           INT32_MAX,    i64{1} << 31, (i64{1} << 31) + 1,
                                   i64{1} << 32, i64{1} << 40, i64{1} << 62, INT64_MAX,    INT64_MIN,
                                   100,          1000};
  return f.PickValueInArray(kSizes);
}

/// A size in [0, max] (1 for an exhausted input), or rarely a special one.
i64 size(FuzzedDataProvider& f, int max) {
  const int v = f.ConsumeIntegral<std::uint8_t>();
  if (v >= 248) return special_size(f);
  return (v + 1) % (max + 1);
}

dtype pick_type(FuzzedDataProvider& f, dtype usual, std::initializer_list<dtype> also_valid = {}) {
  const int v = f.ConsumeIntegral<std::uint8_t>();
  if (v < 200) return usual;
  if (v < 216 && also_valid.size() > 0) return *(also_valid.begin() + (v % also_valid.size()));
  static constexpr int kCodes[] = {0, 1, 2, 3, 4, 5, 6, 7, 8, -1, 1000};  // 8, -1, 1000: outside the enum
  return static_cast<dtype>(kCodes[v % std::size(kCodes)]);
}

void decode_layout(FuzzedDataProvider& f, tensor& t, const tensor* sharing) {
  const int n = t.dims;
  auto packed = [&](const std::array<int, 4>& order) {
    i64 st = 1;
    for (int r = n - 1; r >= 0; --r) {
      t.stride[order[r]] = st;
      st = wrap_mul(st, t.shape[order[r]]);
    }
  };
  std::array<int, 4> order{0, 1, 2, 3};
  const int kind = f.ConsumeIntegralInRange<int>(0, 15);
  if (kind == 8 || kind == 9 || kind == 12) {
    for (int p = f.ConsumeIntegralInRange<int>(0, 23); p > 0; --p)
      std::next_permutation(order.begin(), order.begin() + n);
  }
  packed(order);
  switch (kind) {
    case 10: {  // padded: gaps between rows of every dimension
      i64 st = 1;
      for (int r = n - 1; r >= 0; --r) {
        t.stride[r] = st;
        st = wrap_mul(st, wrap_add(t.shape[r], f.ConsumeIntegralInRange<int>(0, 3)));
      }
      break;
    }
    case 11: {  // broadcast
      const int mask = f.ConsumeIntegral<std::uint8_t>();
      for (int d = 0; d < n; ++d)
        if (mask >> d & 1) t.stride[d] = 0;
      break;
    }
    case 12: {  // negative
      const int mask = f.ConsumeIntegralInRange<int>(1, 15);
      for (int d = 0; d < n; ++d)
        if (mask >> d & 1) t.stride[d] = wrap_mul(t.stride[d], -1);
      break;
    }
    case 13:  // arbitrary small strides: overlapping, gapped, zero, negative
      for (int d = 0; d < n; ++d) t.stride[d] = f.ConsumeIntegralInRange<int>(-4, 16);
      break;
    case 14: {  // one huge stride
      static constexpr i64 kStrides[] = {i64{1} << 31, i64{1} << 40, i64{1} << 62,
                                         INT64_MAX,    INT64_MIN,    -(i64{1} << 40)};
      t.stride[f.ConsumeIntegralInRange<int>(0, n - 1)] = f.PickValueInArray(kStrides);
      break;
    }
    case 15:  // the strides of the tensor whose buffer it shares (interleaved q/k/v, dq/dk/dv)
      if (sharing != nullptr && sharing->dims == n) t.stride = sharing->stride;
      break;
    default: break;
  }
}

/// Decodes tensor @p s with logical shape @p shape.
void decode_tensor(FuzzedDataProvider& f, decoded& c, int s, std::initializer_list<i64> shape, dtype type) {
  tensor& t = c.t[static_cast<std::size_t>(s)];
  t.present = true;
  t.type = type;
  t.dims = static_cast<int>(shape.size());
  std::copy(shape.begin(), shape.end(), t.shape.begin());
  if (f.ConsumeIntegral<std::uint8_t>() >= 240) {  // a wrong size in one dimension
    const int d = f.ConsumeIntegralInRange<int>(0, t.dims - 1);
    auto& x = t.shape[static_cast<std::size_t>(d)];
    x = f.ConsumeBool() ? sat_add(x, f.ConsumeIntegralInRange<int>(-1, 1)) : special_size(f);
  }
  t.rank_claim = t.dims;
  if (f.ConsumeIntegral<std::uint8_t>() >= 250) {
    static constexpr int kRanks[] = {0, 1, 3, 4, 5, -1, 2};
    t.rank_claim = f.PickValueInArray(kRanks);
  }
  t.null_data = f.ConsumeIntegral<std::uint8_t>() >= 248;
  const tensor* sharing = nullptr;
  if (s > 0 && f.ConsumeIntegral<std::uint8_t>() >= 224) {
    const int target = f.ConsumeIntegralInRange<int>(0, s - 1);
    if (c.t[static_cast<std::size_t>(target)].present) {
      t.share = target;
      sharing = &c.t[static_cast<std::size_t>(target)];
      const i64 misalign = f.ConsumeIntegral<std::uint8_t>() >= 240 ? f.ConsumeIntegralInRange<int>(1, 7) : 0;
      t.share_bytes = f.ConsumeIntegralInRange<int>(-48, 48) * static_cast<i64>(item(t.type)) + misalign;
    }
  }
  decode_layout(f, t, sharing);
  // A null pointer with rank 0 is how the API spells "absent" (tensor_view::present()).
  if (t.null_data && t.rank_claim == 0) t = tensor{};
}

decoded decode(FuzzedDataProvider& f) {
  decoded c;
  c.backward = f.ConsumeIntegral<std::uint8_t>() >= 160;
  c.B = size(f, 3);
  c.H = size(f, 6);
  c.Lq = size(f, 12);
  c.Lk = size(f, 40);
  c.d = size(f, 12);
  switch (f.ConsumeIntegralInRange<int>(0, 4)) {
    case 0: c.Hkv = c.H; break;                                      // multi-head
    case 1: c.Hkv = 1; break;                                        // multi-query
    case 2: c.Hkv = c.H % 2 == 0 && c.H > 0 ? c.H / 2 : c.H; break;  // grouped
    case 3: c.Hkv = size(f, 6); break;                               // may not divide H
    default: c.Hkv = special_size(f); break;
  }

  static constexpr dfss::pattern kPatterns[] = {{2, 4},  {1, 2},  {1, 1},   {4, 4}, {3, 8},
                                                {2, 3},  {1, 16}, {16, 16}, {5, 7}, {0, 4},
                                                {2, 1},  {3, 17}, {-1, 2},  {1, 0}, {INT_MAX, INT_MAX},
                                                {17, 17}};
  c.cfg.pattern = f.PickValueInArray(kPatterns);
  static constexpr double kScales[] = {0.0,   1.0,    0.5,       0.125,  1.0 / 3.0, 2.0,
                                       1e-30, 5e-324, -0.0,      -1.0,   kNaN,      kInf,
                                       -kInf, 1e30,   kFloatMax, 3.5e38, 1e300,     std::numeric_limits<double>::max()};
  c.cfg.scale = f.PickValueInArray(kScales);
  c.cfg.causal = f.ConsumeBool();
  // Positions and windows (docs/semantics.md): mostly off, sometimes valid, sometimes not.
  static constexpr std::int64_t kKeyOffsets[] = {0, 0, 0, 0, 4, 8, 16, 3, -4, INT64_MAX};
  c.cfg.key_offset = f.PickValueInArray(kKeyOffsets);
  static constexpr std::int64_t kWindows[] = {0, 0, 0, 0, 0, 1, 5, 64, -1, INT64_MAX};
  c.cfg.sink_tokens = f.PickValueInArray(kWindows);
  c.cfg.recent_tokens = f.PickValueInArray(kWindows);
  {
    const int v = f.ConsumeIntegral<std::uint8_t>();
    static constexpr int kThreads[] = {0, -1, INT_MIN, kMaxThreads, kMaxThreads + 1, INT_MAX};
    c.cfg.num_threads = v < 232 ? 1 + v % 3 : kThreads[v % std::size(kThreads)];
  }
  static constexpr int kBackends[] = {0, 1, 2, 7, -1};  // automatic, reference, cpu, invalid codes
  c.cfg.backend = static_cast<dfss::backend>(f.PickValueInArray(kBackends));
  static constexpr int kIsas[] = {0, 1, 2, 3, 9};  // automatic, generic, avx2, portable, invalid
  c.cfg.cpu_isa = static_cast<dfss::cpu_isa>(f.PickValueInArray(kIsas));
  static constexpr int kAlgorithms[] = {0, 1, 5};  // fused, three_stage, invalid
  c.cfg.cpu_algorithm = static_cast<dfss::cpu_algorithm>(f.PickValueInArray(kAlgorithms));
  c.specials = f.ConsumeIntegral<std::uint8_t>() >= 224;
  c.lens_invalid = f.ConsumeIntegral<std::uint8_t>() >= 224;
  c.seed = f.ConsumeIntegral<u64>();

  static constexpr dtype kFloatTypes[] = {dtype::f32, dtype::f16, dtype::bf16, dtype::f64};
  const dtype qt = pick_type(f, f.PickValueInArray(kFloatTypes));
  const dtype out_t = is_16bit(qt) && f.ConsumeBool() ? qt
                                                      : (qt == dtype::f64 ? dtype::f64
                                                         : is_16bit(qt)   ? dtype::f32
                                                                          : qt);
  const dtype lse_t = qt == dtype::f64 ? dtype::f64 : dtype::f32;
  const i64 B = c.B, H = c.H, Hkv = c.Hkv, Lq = c.Lq, Lk = c.Lk, d = c.d;
  const bool bias = f.ConsumeBool();
  const i64 Bb = f.ConsumeBool() ? B : 1, Hb = f.ConsumeBool() ? H : 1;
  const dtype bias_t = pick_type(f, f.PickValueInArray(kFloatTypes));

  decode_tensor(f, c, Q, {B, Lq, H, d}, qt);
  decode_tensor(f, c, K, {B, Lk, Hkv, d}, pick_type(f, qt));
  decode_tensor(f, c, V, {B, Lk, Hkv, d}, pick_type(f, qt));
  const bool out = !c.backward || f.ConsumeBool();
  if (out && f.ConsumeIntegral<std::uint8_t>() < 252)
    decode_tensor(f, c, OUT, {B, Lq, H, d}, pick_type(f, out_t, {qt, dtype::f32}));
  if (f.ConsumeBool()) decode_tensor(f, c, LSE, {B, H, Lq}, pick_type(f, lse_t));
  if (bias) decode_tensor(f, c, BIAS, {Bb, Hb, Lq, Lk}, bias_t);
  if (f.ConsumeBool()) decode_tensor(f, c, LENS, {B}, pick_type(f, f.ConsumeBool() ? dtype::i32 : dtype::i64));
  if (c.backward) {
    const dtype dq_t = pick_type(f, out_t, {qt, dtype::f32});
    if (f.ConsumeIntegral<std::uint8_t>() < 252) decode_tensor(f, c, DOUT, {B, Lq, H, d}, pick_type(f, qt));
    if (f.ConsumeIntegral<std::uint8_t>() < 252) decode_tensor(f, c, DQ, {B, Lq, H, d}, dq_t);
    if (f.ConsumeIntegral<std::uint8_t>() < 252) decode_tensor(f, c, DK, {B, Lk, Hkv, d}, pick_type(f, dq_t));
    if (f.ConsumeIntegral<std::uint8_t>() < 252) decode_tensor(f, c, DV, {B, Lk, Hkv, d}, pick_type(f, dq_t));
    if ((bias && f.ConsumeBool()) || f.ConsumeIntegral<std::uint8_t>() >= 252) {
      decode_tensor(f, c, DBIAS, {Bb, Hb, Lq, Lk}, pick_type(f, bias_t));
    }
  } else {
    const bool three_stage = c.cfg.cpu_algorithm == dfss::cpu_algorithm::three_stage;
    const int n = c.cfg.pattern.n, m = c.cfg.pattern.m;
    const i64 slots = m >= 1 && Lk >= 0 && n >= 0 && Lk < (i64{1} << 40) ? (Lk + m - 1) / m * n : 1;
    if ((three_stage && f.ConsumeBool()) || f.ConsumeIntegral<std::uint8_t>() >= 252) {
      decode_tensor(f, c, CVALS, {B, H, Lq, slots}, pick_type(f, dtype::f32));
      if (f.ConsumeIntegral<std::uint8_t>() < 248)
        decode_tensor(f, c, CIDX, {B, H, Lq, slots}, pick_type(f, dtype::i32));
    }
    if ((three_stage && f.ConsumeBool()) || f.ConsumeIntegral<std::uint8_t>() >= 252) {
      const i64 words = Lk >= 0 && Lk < (i64{1} << 40) ? (Lk + 15) / 16 : 1;
      decode_tensor(f, c, CMETA, {B, H, Lq, words}, pick_type(f, dtype::u16));
    }
  }
  return c;
}

bool is_output(const decoded& c, int s) {
  if (c.backward) return s == DQ || s == DK || s == DV || s == DBIAS;
  return s == OUT || s == LSE || s == CVALS || s == CIDX || s == CMETA;
}

std::string describe(const decoded& c) {
  std::ostringstream o;
  o << (c.backward ? "backward" : "forward") << " B=" << c.B << " H=" << c.H << " Hkv=" << c.Hkv << " Lq=" << c.Lq
    << " Lk=" << c.Lk << " d=" << c.d << " pattern=" << c.cfg.pattern.n << ":" << c.cfg.pattern.m
    << " scale=" << c.cfg.scale << " causal=" << c.cfg.causal << " key_offset=" << c.cfg.key_offset
    << " sink=" << c.cfg.sink_tokens << " recent=" << c.cfg.recent_tokens << " threads=" << c.cfg.num_threads
    << " backend=" << static_cast<int>(c.cfg.backend) << " isa=" << static_cast<int>(c.cfg.cpu_isa)
    << " algorithm=" << static_cast<int>(c.cfg.cpu_algorithm) << " specials=" << c.specials
    << " invalid lengths=" << c.lens_invalid << " seed=" << c.seed << "\n";
  for (int s = 0; s < kSlots; ++s) {
    const tensor& t = c.t[static_cast<std::size_t>(s)];
    if (!t.present) continue;
    o << "  " << kSlotName[s] << ": " << type_str(t.type) << " rank " << t.rank_claim << " shape [";
    for (int d = 0; d < t.dims; ++d) o << (d ? ", " : "") << t.shape[static_cast<std::size_t>(d)];
    o << "] strides [";
    for (int d = 0; d < t.dims; ++d) o << (d ? ", " : "") << t.stride[static_cast<std::size_t>(d)];
    o << "]" << (t.null_data ? " data=null" : "");
    if (t.share >= 0) o << " in " << kSlotName[t.share] << "'s buffer at byte " << t.share_bytes;
    o << "\n";
  }
  return o.str();
}

/// The buffers: one exact allocation per group of tensors that share memory.
struct arenas {
  std::vector<std::unique_ptr<std::uint8_t[]>> mem;
  std::vector<i64> bytes;
};

void allocate(decoded& c, arenas& a) {
  for (auto& t : c.t) derive_extent(t);
  // A tensor joins the buffer of the tensor it names only when both are allocatable and non-empty.
  for (int s = 0; s < kSlots; ++s) {
    tensor& t = c.t[static_cast<std::size_t>(s)];
    if (!t.present) continue;
    const tensor* o = t.share >= 0 ? &c.t[static_cast<std::size_t>(t.share)] : nullptr;
    if (o != nullptr && o->arena >= 0 && o->count > 0 && o->allocatable && t.count > 0 && t.allocatable) {
      t.arena = o->arena;
      t.pos = o->pos + t.share_bytes;
    } else {
      t.share = -1;
      t.arena = static_cast<int>(a.bytes.size());
      t.pos = 0;
      a.bytes.push_back(0);
    }
  }
  const std::size_t n = a.bytes.size();
  std::vector<i64> lo(n, INT64_MAX), hi(n, INT64_MIN);
  for (auto& t : c.t) {
    if (!t.present) continue;
    lo[static_cast<std::size_t>(t.arena)] = std::min(lo[static_cast<std::size_t>(t.arena)], t.pos + t.lo);
    hi[static_cast<std::size_t>(t.arena)] = std::max(hi[static_cast<std::size_t>(t.arena)], t.pos + t.hi);
  }
  for (std::size_t i = 0; i < n; ++i) {
    a.bytes[i] = hi[i] - lo[i];
    a.mem.emplace_back(new std::uint8_t[static_cast<std::size_t>(a.bytes[i])]());
  }
  for (auto& t : c.t) {
    if (!t.present) continue;
    const auto i = static_cast<std::size_t>(t.arena);
    t.pos -= lo[i];
    t.data = a.mem[i].get() + t.pos;
  }
}

dfss::tensor_view view(const tensor& t) {
  dfss::tensor_view v;
  if (!t.present) return v;
  v.data = t.null_data ? nullptr : t.data;
  v.type = t.type;
  v.rank = t.rank_claim;
  v.shape = t.shape;
  v.stride = t.stride;
  return v;
}

/// The logical values of a tensor in row-major order.
std::vector<double> read(const tensor& t) {
  std::vector<double> x(static_cast<std::size_t>(t.count));
  for (i64 n = 0; n < t.count; ++n) x[static_cast<std::size_t>(n)] = load(t.data, t.type, t.offset(n));
  return x;
}

double max_abs_finite(const std::vector<double>& x) {
  double m = 0;
  for (double e : x)
    if (std::isfinite(e)) m = std::max(m, std::fabs(e));
  return m;
}

/// A packed f64 (or i64) copy of a tensor for the reference.
struct packed {
  std::vector<double> f;
  std::vector<i64> i;
  dfss::tensor_view v;
};

void set_packed_view(dfss::tensor_view& v, void* data, dtype type, const tensor& t) {
  v.data = data;
  v.type = type;
  v.rank = t.dims;
  i64 st = 1;
  for (int d = t.dims - 1; d >= 0; --d) {
    v.shape[static_cast<std::size_t>(d)] = t.shape[static_cast<std::size_t>(d)];
    v.stride[static_cast<std::size_t>(d)] = st;
    st = wrap_mul(st, std::max<i64>(1, t.shape[static_cast<std::size_t>(d)]));
  }
}

packed packed_f64(const tensor& t, const std::vector<double>& values) {
  packed p;
  p.f = values;
  set_packed_view(p.v, p.f.data(), dtype::f64, t);
  return p;
}

packed packed_out(const tensor& t) {
  packed p;
  p.f.assign(static_cast<std::size_t>(t.count), kNaN);
  set_packed_view(p.v, p.f.data(), dtype::f64, t);
  return p;
}

/// Rounding of a value stored in @p t, relative and absolute (subnormal spacing).
double storage_error(dtype t, double ref) {
  switch (t) {
    case dtype::f16: return std::fabs(ref) * 0x1p-11 + 0x1p-25;
    case dtype::bf16: return std::fabs(ref) * 0x1p-8 + 0x1p-134;
    case dtype::f32: return std::fabs(ref) * 0x1p-24 + 0x1p-150;
    default: return std::fabs(ref) * 0x1p-53;
  }
}

double max_finite(dtype t) {
  switch (t) {
    case dtype::f16: return 65504.0;
    case dtype::bf16: return 0x1.fep127;
    case dtype::f32: return kFloatMax;
    default: return std::numeric_limits<double>::max();
  }
}

/// A product of error-bound factors: 0 when a magnitude is 0 (the result is then exact), even if
/// another factor is infinite (a scale near DBL_MAX with f64 inputs).
double product(std::initializer_list<double> factors) {
  double p = 1;
  for (const double f : factors) {
    if (f == 0) return 0;
    p *= f;
  }
  return p;
}

/// Compares output @p s of the call with the reference values @p ref (same logical order).
///
/// @p inf_may_be_nan: an infinite reference value may be NaN in the output. With an infinite value
/// row at a kept key whose probability is tiny, the fp64 reference sums tiny * inf = inf while the
/// fp32 kernels' probability underflows to 0 and 0 * inf is NaN (docs/semantics.md, "Non-finite and
/// extreme inputs").
void compare(const decoded& c, int s, const std::vector<double>& ref, double tol, const char* bound,
             bool inf_may_be_nan = false) {
  const tensor& t = c.t[static_cast<std::size_t>(s)];
  for (i64 n = 0; n < t.count; ++n) {
    const double want = ref[static_cast<std::size_t>(n)];
    const double got = load(t.data, t.type, t.offset(n));
    bool ok;
    if (std::isnan(want)) {
      ok = std::isnan(got);
    } else if (std::isinf(want)) {
      ok = got == want || (inf_may_be_nan && std::isnan(got));
    } else if (std::isinf(got)) {
      // Stored as inf: fine when some value within the tolerance of the reference lies beyond the
      // output type's range on that side.
      const double reach = tol + storage_error(t.type, want);
      ok = got > 0 ? want + reach >= max_finite(t.type) : want - reach <= -max_finite(t.type);
    } else {
      ok = std::fabs(got - want) <= tol + storage_error(t.type, want);
    }
    if (!ok) {
      std::ostringstream o;
      o << kSlotName[s] << " element " << n << " (row-major): got " << got << ", reference " << want << ", tolerance "
        << tol << " (" << bound << ")";
      finding("result differs from the fp64 reference: " + o.str(), describe(c));
    }
  }
}

/// Everything the documented contract says must be rejected, judged independently of the validator.
std::optional<std::string> clearly_invalid(const decoded& c, const std::vector<i64>& lens) {
  const auto& t = c.t;
  for (int s = 0; s < kSlots; ++s) {
    const tensor& x = t[static_cast<std::size_t>(s)];
    if (!x.present) continue;
    if (x.rank_claim != x.dims) return std::string(kSlotName[s]) + " with a wrong rank";
    if (x.null_data && x.count > 0) return std::string(kSlotName[s]) + " with elements and a null data pointer";
    if (!known(x.type)) return std::string(kSlotName[s]) + " with an unknown element type";
    for (int d = 0; d < x.dims; ++d)
      if (x.shape[static_cast<std::size_t>(d)] < 0) return std::string(kSlotName[s]) + " with a negative size";
  }
  if (!t[Q].present || !t[K].present || !t[V].present) return "q, k or v absent";
  if (!is_float(t[Q].type)) return "non-float q";
  if (t[K].type != t[Q].type || t[V].type != t[Q].type) return "k or v of another type than q";
  if (c.backward ? (!t[DOUT].present || !t[DQ].present || !t[DK].present || !t[DV].present) : !t[OUT].present) {
    return "a required output (or dout) absent";
  }
  if (t[Q].shape[3] == 0) return "d = 0";
  if (t[K].present && t[K].shape[1] > INT32_MAX) return "Lk > INT32_MAX";
  const auto pat = c.cfg.pattern;
  if (pat.n < 1 || pat.m < pat.n || pat.m > dfss::kMaxGroupSize) return "an invalid N:M pattern";
  const double sc = c.cfg.scale;
  if (!(sc >= 0) || std::isinf(sc)) return "a negative, NaN or infinite scale";
  if (t[Q].type != dtype::f64 && sc != 0 && (sc > kFloatMax || sc < kFloatMin)) {
    return "a scale outside [FLT_MIN, FLT_MAX] for non-f64 inputs";
  }
  if (c.cfg.num_threads < 0 || c.cfg.num_threads > kMaxThreads) return "num_threads outside [0, 1024]";
  if (c.cfg.key_offset < 0 || c.cfg.key_offset % pat.m != 0 || c.cfg.key_offset > (i64{1} << 62) - t[K].shape[1]) {
    return "a key_offset that is negative, not a multiple of M or past 2^62";
  }
  if (c.cfg.sink_tokens < 0 || c.cfg.recent_tokens < 0 || c.cfg.sink_tokens > (i64{1} << 62) ||
      c.cfg.recent_tokens > (i64{1} << 62)) {
    return "a negative (or huge) sink or recent window";
  }
  if ((c.cfg.sink_tokens > 0 || c.cfg.recent_tokens > 0) && c.cfg.cpu_algorithm == dfss::cpu_algorithm::three_stage &&
      (c.cfg.backend == dfss::backend::cpu || c.cfg.backend == dfss::backend::automatic)) {
    return "sink or recent windows with the three-stage pipeline";
  }
  if (c.cfg.cpu_algorithm != dfss::cpu_algorithm::fused && c.cfg.cpu_algorithm != dfss::cpu_algorithm::three_stage) {
    return "an unknown cpu_algorithm";
  }
  if (t[BIAS].present && !is_float(t[BIAS].type)) return "a non-float bias";
  if (t[DBIAS].present && !t[BIAS].present) return "dbias without bias";
  const bool compressed = t[CVALS].present || t[CIDX].present || t[CMETA].present;
  if (compressed &&
      (c.cfg.cpu_algorithm != dfss::cpu_algorithm::three_stage || c.cfg.backend == dfss::backend::reference)) {
    return "compressed outputs outside the cpu three-stage kernel";
  }
  const i64 H = t[Q].shape[2], Hkv = t[K].shape[2];
  if (Hkv > 0 && H % Hkv != 0) return "Hkv not dividing H";
  if (t[LENS].present && (t[LENS].type == dtype::i32 || t[LENS].type == dtype::i64) &&
      t[LENS].shape[0] == t[Q].shape[0]) {
    for (i64 len : lens)
      if (len < 0 || len > (i64{1} << 62)) return "a key length outside [0, 2^62] (global positions)";
  }
  return std::nullopt;
}

struct outcome {
  bool threw = false;
  dfss::status_code code = dfss::status_code::ok;
  std::string message;
  dfss::kernel_selection selection;
};

template <class Call>
outcome attempt(Call&& call) {
  outcome r;
  try {
    call(r);
  } catch (const dfss::error& e) {
    r.threw = true;
    r.code = e.code();
    r.message = e.what();
  }
  return r;
}

void check_error(const decoded& c, const outcome& r, const char* what) {
  if (!r.threw) return;
  if ((r.code != dfss::status_code::invalid_argument && r.code != dfss::status_code::unsupported) ||
      r.message.empty()) {
    finding(std::string(what) + " threw dfss::error with code " + std::to_string(static_cast<int>(r.code)) +
                " (expected invalid_argument or unsupported): " + r.message,
            describe(c));
  }
}

void run(decoded& c) {
  arenas a;
  allocate(c, a);
  auto& t = c.t;

  bool compute = true;
  i64 work = 1;
  for (const i64 x : {c.B, c.H, c.Hkv, c.Lq, c.Lk, c.d}) {
    compute = compute && x <= 64;  // 64^6 fits in int64
    work *= std::clamp<i64>(x, 0, 64);
  }
  compute = compute && work <= kMaxWork;
  for (const auto& x : t) {
    if (!x.present) continue;
    compute = compute && x.allocatable && x.count <= kMaxElements;
    // The reference gets packed copies of the logical shapes (and an lse from q's): they must be small.
    for (int d = 0; d < x.dims; ++d) compute = compute && x.shape[static_cast<std::size_t>(d)] <= 64;
  }
  // Validation reads one key length per batch: they must be readable and few.
  if (t[LENS].present && (!t[LENS].allocatable || t[LENS].count > kMaxLengthsRead)) t[LENS].present = false;

  rng g{c.seed};
  // Outputs poisoned with NaN (so that an element left unwritten differs from the reference), then
  // the inputs, whose values win where a (rejected) layout overlaps.
  if (compute) {
    for (int s = 0; s < kSlots; ++s) {
      tensor& x = t[static_cast<std::size_t>(s)];
      if (!x.present || !is_output(c, s)) continue;
      for (i64 n = 0; n < x.count; ++n) store(x.data, x.type, x.offset(n), is_float(x.type) ? kNaN : 0x55);
    }
    for (int s : {Q, K, V, BIAS, DOUT}) {
      tensor& x = t[static_cast<std::size_t>(s)];
      if (!x.present) continue;
      for (i64 n = 0; n < x.count; ++n) {
        // Masked bias entries (-inf) as often as in the unit tests' generators (1 in 7).
        const bool masked = s == BIAS && is_float(x.type) && g.next() % 7 == 0;
        store(x.data, x.type, x.offset(n), masked ? -kInf : g.small());
      }
    }
    if (c.specials) {
      for (int k = static_cast<int>(g.next() % 3); k >= 0; --k) {
        const int s = std::array<int, 5>{Q, K, V, BIAS, DOUT}[g.next() % 5];
        tensor& x = t[static_cast<std::size_t>(s)];
        if (!x.present || x.count == 0 || !is_float(x.type)) continue;
        store(x.data, x.type, x.offset(static_cast<i64>(g.next() % static_cast<u64>(x.count))),
              std::array<double, 3>{kNaN, kInf, -kInf}[g.next() % 3]);
      }
    }
  }
  if (t[LENS].present) {
    tensor& x = t[LENS];
    for (i64 n = 0; n < x.count; ++n) {
      i64 len = static_cast<i64>(g.next() % static_cast<u64>(std::clamp<i64>(sat_add(c.Lk, 1), 1, 1 << 20)));
      if (c.lens_invalid && g.next() % 3 == 0) {
        static constexpr i64 kBad[] = {-1, INT32_MAX, INT32_MIN, INT64_MAX, INT64_MIN};
        len = g.next() % 2 ? sat_add(c.Lk, 1) : kBad[g.next() % std::size(kBad)];
      }
      store_int(x.data, x.type, x.offset(n), len);
    }
  }

  // Reads back what the inputs hold (aliased inputs may have overwritten each other).
  auto snapshot = [&](int s) {
    return t[static_cast<std::size_t>(s)].present && compute ? read(t[static_cast<std::size_t>(s)])
                                                             : std::vector<double>{};
  };
  auto read_lengths = [&] {
    std::vector<i64> x;
    for (i64 n = 0; t[LENS].present && n < t[LENS].count; ++n) {
      x.push_back(load_int(t[LENS].data, t[LENS].type, t[LENS].offset(n)));
    }
    return x;
  };
  const std::vector<i64> lens = read_lengths();
  const std::vector<double> q = snapshot(Q), k = snapshot(K), v = snapshot(V), bias = snapshot(BIAS);

  // The reference: packed f64 copies, same options, one thread.
  dfss::attention_config rcfg = c.cfg;
  rcfg.backend = dfss::backend::reference;
  rcfg.num_threads = 1;
  rcfg.cpu_isa = dfss::cpu_isa::automatic;
  rcfg.cpu_algorithm = dfss::cpu_algorithm::fused;
  packed rq, rk, rv, rbias, rlens, rout, rlse;
  dfss::forward_args rf;
  bool ref_forward_ok = false;
  if (compute) {
    rq = packed_f64(t[Q], q), rk = packed_f64(t[K], k), rv = packed_f64(t[V], v);
    rf.q = rq.v, rf.k = rk.v, rf.v = rv.v;
    if (t[BIAS].present) rbias = packed_f64(t[BIAS], bias), rf.bias = rbias.v;
    if (t[LENS].present) {
      rlens.i = lens;
      set_packed_view(rlens.v, rlens.i.data(), dtype::i64, t[LENS]);
      rf.key_lengths = rlens.v;
    }
    rout = packed_out(t[Q]);
    tensor lse_shape;
    lse_shape.dims = 3;
    lse_shape.shape = {t[Q].shape[0], t[Q].shape[2], t[Q].shape[1], 0};
    derive_extent(lse_shape);
    rlse = packed_out(lse_shape);
    rf.out = rout.v, rf.lse = rlse.v;
    ref_forward_ok = !attempt([&](outcome&) { dfss::attention_forward(rf, rcfg); }).threw;
  }

  // The backward's optional forward results: the reference's, stored in their types and layouts.
  bool compare_values = compute;
  if (c.backward && compute) {
    std::vector<double> given[2];
    for (int s : {OUT, LSE}) {
      tensor& x = t[static_cast<std::size_t>(s)];
      if (!x.present) continue;
      const packed& from = s == OUT ? rout : rlse;
      const bool same_shape = ref_forward_ok && x.count == static_cast<i64>(from.f.size());
      for (i64 n = 0; n < x.count; ++n) {
        store(x.data, x.type, x.offset(n), same_shape ? from.f[static_cast<std::size_t>(n)] : g.small());
        given[s == LSE].push_back(load(x.data, x.type, x.offset(n)));
      }
    }
    // Where out or lse share memory with another input or overlap themselves, the values the
    // reference saw, or the forward results given, may have changed: the call still runs (memory
    // safety, error contract), without a value comparison.
    compare_values = q == snapshot(Q) && k == snapshot(K) && v == snapshot(V) && bias == snapshot(BIAS) &&
                     lens == read_lengths() && given[0] == snapshot(OUT) && given[1] == snapshot(LSE);
  }
  const std::vector<double> dout = snapshot(DOUT);
  // The semantics page fixes how NaN and infinities propagate in the forward pass only: gradients
  // are compared on finite inputs (a bias may hold -inf, a mask). Values count as they are read back:
  // aliased inputs can carry another input's -inf.
  if (c.backward) {
    auto finite = [](const std::vector<double>& x) {
      return std::all_of(x.begin(), x.end(), [](double e) { return std::isfinite(e); });
    };
    const bool masks_only = std::all_of(bias.begin(), bias.end(), [](double e) { return e < kInf; });
    compare_values = compare_values && finite(q) && finite(k) && finite(v) && finite(dout) && masks_only;
  }

  std::vector<std::vector<std::uint8_t>> before;
  for (std::size_t i = 0; i < a.mem.size(); ++i) {
    before.emplace_back(a.mem[i].get(), a.mem[i].get() + a.bytes[i]);
  }

  dfss::forward_args fa;
  dfss::backward_args ba;
  if (c.backward) {
    ba.q = view(t[Q]), ba.k = view(t[K]), ba.v = view(t[V]), ba.out = view(t[OUT]), ba.lse = view(t[LSE]);
    ba.dout = view(t[DOUT]), ba.dq = view(t[DQ]), ba.dk = view(t[DK]), ba.dv = view(t[DV]);
    ba.bias = view(t[BIAS]), ba.dbias = view(t[DBIAS]), ba.key_lengths = view(t[LENS]);
  } else {
    fa.q = view(t[Q]), fa.k = view(t[K]), fa.v = view(t[V]), fa.out = view(t[OUT]), fa.lse = view(t[LSE]);
    fa.bias = view(t[BIAS]), fa.key_lengths = view(t[LENS]);
    fa.compressed_values = view(t[CVALS]), fa.compressed_indices = view(t[CIDX]), fa.compressed_meta = view(t[CMETA]);
  }

  const outcome sel = attempt(
      [&](outcome& r) { r.selection = c.backward ? dfss::select_kernel(ba, c.cfg) : dfss::select_kernel(fa, c.cfg); });
  check_error(c, sel, "select_kernel");
  const auto invalid = clearly_invalid(c, lens);
  if (invalid && !sel.threw) finding("select_kernel accepted " + *invalid, describe(c));

  outcome call;
  if (compute) {
    call = attempt([&](outcome&) {
      if (c.backward)
        dfss::attention_backward(ba, c.cfg);
      else
        dfss::attention_forward(fa, c.cfg);
    });
    check_error(c, call, c.backward ? "attention_backward" : "attention_forward");
    if (invalid && !call.threw) finding("the call accepted " + *invalid, describe(c));
    // The one documented exception: compressed outputs with a kernel other than the three-stage one.
    const bool compressed_elsewhere =
        (t[CVALS].present || t[CMETA].present) && sel.selection.kind != dfss::kernel_kind::cpu_three_stage_forward;
    const bool agree = sel.threw ? call.threw && call.code == sel.code
                       : !sel.selection.supported()
                           ? call.threw && call.code == dfss::status_code::unsupported
                           : !call.threw || (call.code == dfss::status_code::unsupported && compressed_elsewhere);
    if (!agree) {
      finding("select_kernel (" +
                  (sel.threw                   ? sel.message
                   : sel.selection.supported() ? sel.selection.name
                                               : "unsupported: " + sel.selection.reason) +
                  ") disagrees with the call (" + (call.threw ? call.message : "succeeded") + ")",
              describe(c));
    }
  }

  // Nothing outside the outputs' elements may change (inputs are read-only; gaps between strided
  // output elements belong to the caller).
  std::vector<std::vector<bool>> output_byte(a.mem.size());
  for (std::size_t i = 0; i < a.mem.size(); ++i) output_byte[i].assign(static_cast<std::size_t>(a.bytes[i]), false);
  if (compute) {
    for (int s = 0; s < kSlots; ++s) {
      const tensor& x = t[static_cast<std::size_t>(s)];
      if (!x.present || !is_output(c, s)) continue;
      const auto es = static_cast<i64>(item(x.type));
      for (i64 n = 0; n < x.count; ++n) {
        for (i64 b = 0; b < es; ++b)
          output_byte[static_cast<std::size_t>(x.arena)][static_cast<std::size_t>(x.pos + x.offset(n) * es + b)] = true;
      }
    }
  }
  for (std::size_t i = 0; i < a.mem.size(); ++i) {
    for (i64 b = 0; b < a.bytes[i]; ++b) {
      if (!output_byte[i][static_cast<std::size_t>(b)] &&
          a.mem[i][static_cast<std::size_t>(b)] != before[i][static_cast<std::size_t>(b)]) {
        finding("a byte outside the outputs' elements changed (buffer " + std::to_string(i) + ", byte " +
                    std::to_string(b) + ")",
                describe(c));
      }
    }
  }
  if (!compute || call.threw) return;
  if (!ref_forward_ok) finding("the call succeeded but the fp64 reference rejects the same problem", describe(c));

  const tensor &tq = t[Q], &tk = t[K];
  const i64 B = tq.shape[0], Lq_ = tq.shape[1], H = tq.shape[2], Hkv = tk.shape[2];
  auto same_shape = [&](int s, std::initializer_list<i64> want) {
    const tensor& x = t[static_cast<std::size_t>(s)];
    if (x.present && !std::equal(want.begin(), want.end(), x.shape.begin())) {
      finding(std::string("the call accepted ") + kSlotName[s] + " of a shape that does not fit q, k and v",
              describe(c));
    }
  };

  // Tolerances. Scores are exact (small integers), so a correct kernel keeps exactly the
  // reference's entries and only the softmax and the sums round. Every bound is
  // (a small constant + the number of terms summed) * eps * A * (a bound on the magnitude of the
  // terms), where eps is the unit roundoff of the arithmetic (fp32, or fp64 for f64 inputs, which
  // only the reference takes) and A = 1 + 2 S with S a bound on |scale * score|: the exponent's
  // argument is formed from scaled scores up to S, so each probability carries a relative error up
  // to about eps * 2 S. The 16 (forward) and 64 (backward) are the constants the unit tests use for
  // the fixed rounding steps (exp, division, conversions); see docs/testing.md.
  const double eps = tq.type == dtype::f64 ? 0x1p-52 : 0x1p-23;
  const auto Lk = static_cast<double>(tk.shape[1]), d = static_cast<double>(tq.shape[3]);
  const double scale = c.cfg.scale > 0 ? c.cfg.scale : 1.0 / std::sqrt(d);
  const double Qm = max_abs_finite(q), Km = max_abs_finite(k), Vm = max_abs_finite(v), Bm = max_abs_finite(bias);
  const double S = scale * (d * Qm * Km + Bm);
  const double A = 1 + 2 * S;
  // The semantics page promises the reference's result for scaled scores up to float max only.
  if (tq.type != dtype::f64 && S > kFloatMax) compare_values = false;
  // The backward recomputes P = exp(scale s - LSE) from an fp32 LSE, whose rounding alone (eps S)
  // exceeds 1 in the exponent once S > 2^23: there the probabilities, and the gradients, carry no
  // information, and the semantics page makes no promise (it does for the forward pass).
  if (c.backward && tq.type != dtype::f64 && S > 0x1p23) compare_values = false;

  if (!c.backward) {
    same_shape(OUT, {B, Lq_, H, tq.shape[3]});
    same_shape(LSE, {B, H, Lq_});
    if (!compare_values) return;
    // |O| <= max|v|: Lk probabilities, each with the relative error above, weight value rows.
    const bool v_infinite = std::any_of(v.begin(), v.end(), [](double x) { return std::isinf(x); });
    // The avx3_bf16 forward rounds P to bf16 for bf16 inputs (docs/semantics.md, "Precision"): each
    // weight moves by at most 2^-8 of itself, so O by at most 2^-8 max|v| more.
    const bool p_in_bf16 =
        tq.type == dtype::bf16 && sel.selection.kind == dfss::kernel_kind::cpu_fused_forward_avx3_bf16;
    compare(c, OUT, rout.f, product({16 + Lk, eps, A, Vm}) + (p_in_bf16 ? 0x1p-8 * Vm : 0.0),
            p_in_bf16 ? "(16 + Lk) eps A max|v| + 2^-8 max|v| (P in bf16)" : "(16 + Lk) eps A max|v|",
            v_infinite && tq.type != dtype::f64);
    // LSE = scale * max + log(sum): the first term to eps * S, the sum's logarithm as O's weights.
    if (t[LSE].present) compare(c, LSE, rlse.f, product({16 + Lk, eps, A + S}), "(16 + Lk) eps (A + S)");
    return;
  }

  same_shape(DQ, {B, Lq_, H, tq.shape[3]});
  same_shape(DK, {B, tk.shape[1], Hkv, tq.shape[3]});
  same_shape(DV, {B, tk.shape[1], Hkv, tq.shape[3]});
  if (t[DBIAS].present) same_shape(DBIAS, {t[BIAS].shape[0], t[BIAS].shape[1], t[BIAS].shape[2], t[BIAS].shape[3]});
  packed rdout = packed_f64(t[DOUT], dout);
  packed rdq = packed_out(tq), rdk = packed_out(tk), rdv = packed_out(t[V]), rdbias;
  dfss::backward_args rb;
  rb.q = rq.v, rb.k = rk.v, rb.v = rv.v, rb.dout = rdout.v, rb.bias = rf.bias, rb.key_lengths = rf.key_lengths;
  rb.dq = rdq.v, rb.dk = rdk.v, rb.dv = rdv.v;
  if (t[DBIAS].present) rdbias = packed_out(t[BIAS]), rb.dbias = rdbias.v;
  if (attempt([&](outcome&) { dfss::attention_backward(rb, rcfg); }).threw) {
    finding("the call succeeded but the fp64 reference backward rejects the same problem", describe(c));
  }
  if (!compare_values) return;
  // A given 16-bit out carries its storage rounding into D = rowsum(dO * O).
  const double e =
      t[OUT].present && is_16bit(t[OUT].type) ? std::max(eps, t[OUT].type == dtype::f16 ? 0x1p-11 : 0x1p-8) : eps;
  const double Dm = max_abs_finite(dout);
  const double G = d * Dm * Vm;                                           // bounds |dP| = |dO . v| and |D| = |dO . O|
  const double T = static_cast<double>(H / std::max<i64>(1, Hkv) * Lq_);  // rows reaching one key
  const double C =
      t[BIAS].present ? static_cast<double>((t[BIAS].shape[0] == 1 ? B : 1) * (t[BIAS].shape[1] == 1 ? H : 1)) : 0;
  // dV_j sums T terms P dO, each at most max|dO|.
  compare(c, DV, rdv.f, product({64 + T, e, A, T, Dm}), "(64 + T) e A T max|dO|");
  // The fp32 kernels sum terms scale dS k (up to scale 2G max|k| each) whose running sum may pass
  // float max before cancelling to a representable gradient: near float max the gradients carry
  // no promise (docs/testing.md, "Fuzzing").
  if (tq.type != dtype::f64 && product({Lk + T, scale, 2 * G, std::max(Km, Qm * T)}) > kFloatMax) return;
  // dS = P (dP - D) is at most 2 G per unit of probability; dQ_i = scale sum_j dS_ij k_j with
  // sum_j P_ij = 1; dK_j sums T rows; dBias sums C broadcast copies of scale dS.
  compare(c, DQ, rdq.f, product({64 + Lk + d, e, A, scale, 2 * G, Km}), "(64 + Lk + d) e A scale 2G max|k|");
  compare(c, DK, rdk.f, product({64 + Lk + d + T, e, A, scale, 2 * G, Qm, T}),
          "(64 + Lk + d + T) e A scale 2G max|q| T");
  if (t[DBIAS].present) {
    compare(c, DBIAS, rdbias.f, product({64 + Lk + d + C, e, A, scale, 2 * G, C}), "(64 + Lk + d + C) e A scale 2G C");
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider f(data, size);
  decoded c = decode(f);
  // To see the call when a sanitizer stops the process inside the library (before any check of ours
  // could describe it): DFSS_FUZZ_VERBOSE=1 fuzz_api REPRODUCER.
  static const bool verbose = std::getenv("DFSS_FUZZ_VERBOSE") != nullptr;
  if (verbose) std::fprintf(stderr, "%s", describe(c).c_str());
  run(c);
  return 0;
}
