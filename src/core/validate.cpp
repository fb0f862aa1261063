// Validation of public API arguments (see validate.hpp). Every check produces a message of the form
// "<op>: argument '<name>': expected <what>, got <value>".
#include "core/validate.hpp"

#include "core/device_memory.hpp"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

namespace dfss::core {
namespace {

std::string shape_str(const tensor_view& t) {
  std::ostringstream s;
  s << '[';
  for (int i = 0; i < t.rank && i < kMaxRank; ++i) s << (i ? ", " : "") << t.shape[i];
  s << ']';
  return s.str();
}

/// Collects the first failure; later checks are skipped once one failed.
class checker {
 public:
  explicit checker(const char* op) : op_(op) {}
  bool failed() const { return !st_.ok(); }
  status result() const { return st_; }

  void fail(const std::string& arg, const std::string& expected, const std::string& got,
            status_code code = status_code::invalid_argument) {
    if (failed()) return;
    st_.code = code;
    st_.message = std::string(op_) + ": argument '" + arg + "': expected " + expected + ", got " + got;
  }

 private:
  const char* op_;
  status st_;
};

bool mul_overflows(std::int64_t a, std::int64_t b, std::int64_t& out) {
  return __builtin_mul_overflow(a, b, &out);
}

/// Number of elements of a validated view (0 when any dimension is 0).
std::int64_t numel_of(const tensor_view& t) {
  std::int64_t n = 1;
  for (int d = 0; d < t.rank; ++d) n *= t.shape[d];
  return n;
}

/// Checks presence, rank, non-negative sizes and strides, alignment, and that the largest element
/// offset (in bytes) fits in int64. A view with no elements (some dimension is 0) may have a null
/// data pointer: it addresses no memory (docs/semantics.md, "Shapes"). Returns false (after
/// recording the failure) on any problem.
bool check_view(checker& c, const char* name, const tensor_view& t, int rank) {
  if (c.failed()) return false;
  if (t.rank != rank) {
    c.fail(name, std::to_string(rank) + " dimensions", std::to_string(t.rank) + " dimensions " +
                                                           (t.rank >= 0 && t.rank <= kMaxRank ? shape_str(t) : ""));
    return false;
  }
  const std::size_t esize = dtype_size(t.type);
  if (esize == 0) {
    c.fail(name, "a known element type", "type code " + std::to_string(static_cast<int>(t.type)));
    return false;
  }
  bool empty = false;
  for (int d = 0; d < rank; ++d) {
    if (t.shape[d] < 0) {
      c.fail(name, "shape[" + std::to_string(d) + "] >= 0", std::to_string(t.shape[d]) + " (shape " + shape_str(t) + ")");
      return false;
    }
    empty = empty || t.shape[d] == 0;
  }
  for (int d = 0; d < rank; ++d) {
    if (t.stride[d] < 0) {
      c.fail(name, "stride[" + std::to_string(d) + "] >= 0", std::to_string(t.stride[d]));
      return false;
    }
  }
  if (t.data == nullptr && !empty) {
    c.fail(name, "a non-null data pointer (only a view with no elements may have none)",
           "nullptr with shape " + shape_str(t));
    return false;
  }
  if (reinterpret_cast<std::uintptr_t>(t.data) % esize != 0) {
    std::ostringstream got;
    got << "address " << t.data;
    c.fail(name, "data aligned to " + std::to_string(esize) + " bytes (its element size)", got.str());
    return false;
  }
  std::int64_t numel = 1;
  std::int64_t max_off = 0;
  for (int d = 0; d < rank; ++d) {
    std::int64_t span = 0;
    if (mul_overflows(numel, t.shape[d], numel) ||
        (t.shape[d] > 0 && mul_overflows(t.shape[d] - 1, t.stride[d], span)) ||
        __builtin_add_overflow(max_off, span, &max_off)) {
      c.fail(name, "sizes and strides whose products fit in 64 bits",
             "shape " + shape_str(t) + " that overflows");
      return false;
    }
  }
  if (empty) return true;
  std::int64_t bytes = 0;
  std::int64_t elements = 0;  // max_off + 1, which overflows for an offset of exactly INT64_MAX
  if (__builtin_add_overflow(max_off, 1, &elements) ||
      mul_overflows(elements, static_cast<std::int64_t>(esize), bytes) ||
      static_cast<std::uint64_t>(bytes) > UINTPTR_MAX - reinterpret_cast<std::uintptr_t>(t.data)) {
    c.fail(name, "a byte extent that fits in the address space", "shape " + shape_str(t) + " that overflows");
    return false;
  }
  return true;
}

void check_type(checker& c, const char* name, const tensor_view& t, dtype expected) {
  if (c.failed() || t.type == expected) return;
  c.fail(name, std::string("element type ") + dtype_name(expected), dtype_name(t.type));
}

void check_dim(checker& c, const char* name, const tensor_view& t, int d, const char* what,
               std::int64_t expected) {
  if (c.failed() || t.shape[d] == expected) return;
  c.fail(name, "shape[" + std::to_string(d) + "] (" + what + ") == " + std::to_string(expected),
         std::to_string(t.shape[d]) + " (shape " + shape_str(t) + ")");
}

struct byte_range {
  std::uintptr_t begin, end;  // [begin, end)
};

byte_range range_of(const tensor_view& t) {
  const auto b = reinterpret_cast<std::uintptr_t>(t.data);
  if (numel_of(t) == 0) return {b, b};  // addresses nothing, overlaps nothing
  std::int64_t max_off = 0;
  for (int d = 0; d < t.rank; ++d) max_off += (t.shape[d] - 1) * t.stride[d];
  const auto esize = static_cast<std::int64_t>(dtype_size(t.type));
  return {b, b + static_cast<std::uintptr_t>((max_off + 1) * esize)};
}

/// True when no two index tuples of @p t address the same element: sorted by stride, every stride
/// exceeds the largest offset reachable through the smaller ones (dimensions of size 1 are free).
bool is_non_self_overlapping(const tensor_view& t) {
  std::vector<int> dims;
  for (int d = 0; d < t.rank; ++d)
    if (t.shape[d] > 1) dims.push_back(d);
  std::sort(dims.begin(), dims.end(), [&](int a, int b) { return t.stride[a] < t.stride[b]; });
  std::int64_t reach = 0;
  for (int d : dims) {
    if (t.stride[d] <= reach) return false;
    reach += (t.shape[d] - 1) * t.stride[d];
  }
  return true;
}

/// Whether @p delta (elements) is a difference of two offsets of a view with strides @p t; exact for
/// non-self-overlapping views: the digit of each dimension, largest stride first, can only be the
/// floor or the ceiling of the remainder over the stride.
bool delta_reachable(const tensor_view& t, std::vector<int>& dims, std::size_t k, std::int64_t delta) {
  if (k == dims.size()) return delta == 0;
  const int d = dims[k];
  const std::int64_t s = t.stride[d];
  const std::int64_t lo = delta >= 0 ? delta / s : -((-delta + s - 1) / s);
  for (std::int64_t digit : {lo, lo + 1}) {
    if (digit <= -t.shape[d] || digit >= t.shape[d]) continue;
    if (delta_reachable(t, dims, k + 1, delta - digit * s)) return true;
  }
  return false;
}

/// Whether views @p a and @p b can share an element. Disjoint byte ranges never do; two views with
/// the same element size and strides (e.g. dq, dk, dv in one packed [B, L, 3, H, d] buffer) are
/// checked exactly; anything else that shares bytes is treated as overlapping.
bool may_overlap(const tensor_view& a, const tensor_view& b) {
  const byte_range ra = range_of(a), rb = range_of(b);
  if (ra.begin == ra.end || rb.begin == rb.end) return false;
  if (ra.end <= rb.begin || rb.end <= ra.begin) return false;
  const auto esize = static_cast<std::int64_t>(dtype_size(a.type));
  if (esize != static_cast<std::int64_t>(dtype_size(b.type)) || a.rank != b.rank) return true;
  for (int d = 0; d < a.rank; ++d) {
    if (a.shape[d] != b.shape[d] || a.stride[d] != b.stride[d]) return true;
  }
  if (!is_non_self_overlapping(a)) return true;
  const auto bytes = static_cast<std::int64_t>(rb.begin) - static_cast<std::int64_t>(ra.begin);
  if (bytes % esize != 0) return true;
  std::vector<int> dims;
  for (int d = 0; d < a.rank; ++d)
    if (a.shape[d] > 1) dims.push_back(d);
  std::sort(dims.begin(), dims.end(), [&](int x, int y) { return a.stride[x] > a.stride[y]; });
  return delta_reachable(a, dims, 0, bytes / esize);
}

struct named_view {
  const char* name;
  const tensor_view* view;
};

void check_outputs(checker& c, const std::vector<named_view>& outputs,
                   const std::vector<named_view>& inputs) {
  for (const auto& o : outputs) {
    if (c.failed()) return;
    if (numel_of(*o.view) > 0 && !is_non_self_overlapping(*o.view)) {
      std::ostringstream got;
      got << "strides [";
      for (int d = 0; d < o.view->rank; ++d) got << (d ? ", " : "") << o.view->stride[d];
      got << "] for shape " << shape_str(*o.view);
      c.fail(o.name, "an output layout whose elements do not alias each other", got.str());
      return;
    }
  }
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    for (const auto& in : inputs) {
      if (!c.failed() && may_overlap(*outputs[i].view, *in.view)) {
        c.fail(outputs[i].name, std::string("memory disjoint from input '") + in.name + "'",
               "an overlapping buffer");
      }
    }
    for (std::size_t j = i + 1; j < outputs.size(); ++j) {
      if (!c.failed() && may_overlap(*outputs[i].view, *outputs[j].view)) {
        c.fail(outputs[i].name, std::string("memory disjoint from output '") + outputs[j].name + "'",
               "an overlapping buffer");
      }
    }
  }
}

void copy_strides(const tensor_view& t, std::int64_t* dst, int n) {
  for (int d = 0; d < n; ++d) dst[d] = t.shape[d] == 1 ? 0 : t.stride[d];
}

/// Validates everything the forward and backward share: q, k, v, options, bias, key lengths.
void check_common(checker& c, const tensor_view& q, const tensor_view& k, const tensor_view& v,
                  const tensor_view& bias, const tensor_view& key_lengths, const tensor_view& query_offset,
                  const attention_config& config, attention_params& p) {
  if (!check_view(c, "q", q, 4)) return;
  if (!dtype_is_floating(q.type)) {
    c.fail("q", "element type f64, f32, f16 or bf16", dtype_name(q.type));
    return;
  }
  p.batch = q.shape[0];
  p.seqlen_q = q.shape[1];
  p.heads = q.shape[2];
  p.head_dim = q.shape[3];
  if (p.head_dim < 1) {
    c.fail("q", "shape[3] (head_dim) >= 1", "0 (shape " + shape_str(q) + ")");
    return;
  }
  if (p.seqlen_q > kMaxSeqLen) {
    c.fail("q", "shape[1] (seqlen_q) <= " + std::to_string(kMaxSeqLen), std::to_string(p.seqlen_q),
           status_code::unsupported);
    return;
  }
  if (p.head_dim > kMaxHeadDim) {
    c.fail("q", "shape[3] (head_dim) <= " + std::to_string(kMaxHeadDim),
           std::to_string(p.head_dim), status_code::unsupported);
    return;
  }
  if (!check_view(c, "k", k, 4)) return;
  check_type(c, "k", k, q.type);
  check_dim(c, "k", k, 0, "batch", p.batch);
  check_dim(c, "k", k, 3, "head_dim", p.head_dim);
  if (c.failed()) return;
  p.seqlen_k = k.shape[1];
  p.heads_kv = k.shape[2];
  if (p.seqlen_k > kMaxSeqLen) {
    c.fail("k", "shape[1] (seqlen_k) <= " + std::to_string(kMaxSeqLen) +
                    " (key indices are 32-bit in the kernels and the compressed export)",
           std::to_string(p.seqlen_k), status_code::unsupported);
    return;
  }
  if (p.heads_kv == 0 && p.heads != 0) {
    c.fail("k", "shape[2] (heads_kv) >= 1 for " + std::to_string(p.heads) + " query heads", "0");
    return;
  }
  if (p.heads_kv != 0 && p.heads % p.heads_kv != 0) {
    c.fail("k", "shape[2] (heads_kv) to divide the " + std::to_string(p.heads) + " query heads",
           std::to_string(p.heads_kv));
    return;
  }
  if (!check_view(c, "v", v, 4)) return;
  check_type(c, "v", v, q.type);
  check_dim(c, "v", v, 0, "batch", p.batch);
  check_dim(c, "v", v, 1, "seqlen_k", p.seqlen_k);
  check_dim(c, "v", v, 2, "heads_kv", p.heads_kv);
  check_dim(c, "v", v, 3, "head_dim", p.head_dim);
  if (c.failed()) return;

  p.input_type = q.type;
  p.lse_type = q.type == dtype::f64 ? dtype::f64 : dtype::f32;
  p.q = q.data;
  p.k = k.data;
  p.v = v.data;
  copy_strides(q, p.q_stride, 4);
  copy_strides(k, p.k_stride, 4);
  copy_strides(v, p.v_stride, 4);

  const pattern pat = config.pattern;
  if (pat.n < 1 || pat.m < pat.n || pat.m > kMaxGroupSize) {
    c.fail("config.pattern", "1 <= N <= M <= " + std::to_string(kMaxGroupSize),
           std::to_string(pat.n) + ":" + std::to_string(pat.m));
    return;
  }
  p.pattern_n = pat.n;
  p.pattern_m = pat.m;
  if (!std::isfinite(config.scale) || config.scale < 0.0) {
    std::ostringstream got;
    got << config.scale;
    c.fail("config.scale", "a finite value >= 0 (0 means 1/sqrt(head_dim))", got.str());
    return;
  }
  const double fmin = static_cast<double>(std::numeric_limits<float>::min());
  const double fmax = static_cast<double>(std::numeric_limits<float>::max());
  if (p.input_type != dtype::f64 && config.scale != 0.0 && (config.scale < fmin || config.scale > fmax)) {
    // f32, f16 and bf16 inputs are computed in fp32, where a scale above float max does not exist
    // and one below the smallest normal float rounds to 0 or loses its precision.
    std::ostringstream want, got;
    want << "0 or a value in [" << fmin << ", " << fmax << "] (normal fp32 numbers) for " << dtype_name(p.input_type)
         << " inputs, which are computed in fp32";
    got << config.scale;
    c.fail("config.scale", want.str(), got.str());
    return;
  }
  p.scale = config.scale > 0.0 ? config.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  p.causal = config.causal;
  if (config.key_offset < 0 || config.key_offset > kMaxPosition - p.seqlen_k || config.key_offset % pat.m != 0) {
    c.fail("config.key_offset",
           "a multiple of M = " + std::to_string(pat.m) + " (groups stay aligned) in [0, " +
               std::to_string(kMaxPosition - p.seqlen_k) + "]",
           std::to_string(config.key_offset));
    return;
  }
  p.key_offset = config.key_offset;
  for (const auto& [name, value] : {std::pair{"config.sink_tokens", config.sink_tokens},
                                    std::pair{"config.recent_tokens", config.recent_tokens}}) {
    if (value < 0 || value > kMaxPosition) {
      c.fail(name, "a value in [0, " + std::to_string(kMaxPosition) + "] (0: no window)", std::to_string(value));
      return;
    }
  }
  p.sink_tokens = config.sink_tokens;
  p.recent_tokens = config.recent_tokens;
  if ((p.sink_tokens > 0 || p.recent_tokens > 0) && config.cpu_algorithm == cpu_algorithm::three_stage &&
      (config.backend == backend::cpu || config.backend == backend::automatic)) {
    // A whole group holds M kept keys, the compressed N-of-M rows of the pipeline have room for N.
    c.fail(p.sink_tokens > 0 ? "config.sink_tokens" : "config.recent_tokens",
           "0 with cpu_algorithm three_stage (its compressed N-of-M format cannot hold a group kept whole; "
           "use cpu_algorithm fused)",
           std::to_string(p.sink_tokens > 0 ? p.sink_tokens : p.recent_tokens));
    return;
  }
  if (config.num_threads < 0 || config.num_threads > kMaxThreads) {
    c.fail("config.num_threads",
           "a value in [0, " + std::to_string(kMaxThreads) + "] (0 means all hardware threads)",
           std::to_string(config.num_threads));
    return;
  }
  p.num_threads = config.num_threads;
  if (config.cpu_algorithm != cpu_algorithm::fused && config.cpu_algorithm != cpu_algorithm::three_stage) {
    c.fail("config.cpu_algorithm", "fused or three_stage",
           "value " + std::to_string(static_cast<int>(config.cpu_algorithm)));
    return;
  }

  if (bias.present()) {
    if (!check_view(c, "bias", bias, 4)) return;
    if (!dtype_is_floating(bias.type)) {
      c.fail("bias", "element type f64, f32, f16 or bf16", dtype_name(bias.type));
      return;
    }
    const std::int64_t want[4] = {p.batch, p.heads, p.seqlen_q, p.seqlen_k};
    const char* names[4] = {"batch or 1", "heads or 1", "seqlen_q", "seqlen_k"};
    for (int d = 0; d < 4; ++d) {
      const bool ok = bias.shape[d] == want[d] || (d < 2 && bias.shape[d] == 1);
      if (!ok) {
        c.fail("bias", "shape[" + std::to_string(d) + "] (" + names[d] + ") == " + std::to_string(want[d]),
               std::to_string(bias.shape[d]) + " (shape " + shape_str(bias) + ")");
        return;
      }
    }
    p.bias = bias.data;
    p.bias_type = bias.type;
    copy_strides(bias, p.bias_stride, 4);
  }

  if (key_lengths.present()) {
    if (!check_view(c, "key_lengths", key_lengths, 1)) return;
    if (key_lengths.type != dtype::i32 && key_lengths.type != dtype::i64) {
      c.fail("key_lengths", "element type i32 or i64", dtype_name(key_lengths.type));
      return;
    }
    check_dim(c, "key_lengths", key_lengths, 0, "batch", p.batch);
    if (c.failed()) return;
    // The values live in device memory for the cuda backend (or when the caller passed device
    // memory, which the selector routes or refuses) and reading them would need a host
    // synchronisation: there the kernels clamp each length to [0, seqlen_k] instead.
    const bool on_device = config.backend == backend::cuda || is_device_pointer(key_lengths.data);
    const std::int64_t checked_batches = on_device ? 0 : p.batch;
    for (std::int64_t b = 0; b < checked_batches; ++b) {
      const std::int64_t off = b * key_lengths.stride[0];
      const std::int64_t len = key_lengths.type == dtype::i32
                                   ? static_cast<const std::int32_t*>(key_lengths.data)[off]
                                   : static_cast<const std::int64_t*>(key_lengths.data)[off];
      if (len < 0 || len > kMaxPosition) {
        c.fail("key_lengths", "values in [0, " + std::to_string(kMaxPosition) +
                                  "] (valid keys in global positions; lengths beyond key_offset + seqlen_k = " +
                                  std::to_string(p.key_offset + p.seqlen_k) + " leave every key valid)",
               std::to_string(len) + " at index " + std::to_string(b));
        return;
      }
    }
    p.key_lengths = key_lengths.data;
    p.key_lengths_type = key_lengths.type;
    p.key_lengths_stride = key_lengths.stride[0];
  }

  if (query_offset.present()) {
    if (!check_view(c, "query_offset", query_offset, 1)) return;
    if (query_offset.type != dtype::i32 && query_offset.type != dtype::i64) {
      c.fail("query_offset", "element type i32 or i64", dtype_name(query_offset.type));
      return;
    }
    check_dim(c, "query_offset", query_offset, 0, "batch", p.batch);
    if (c.failed()) return;
    if (config.backend == backend::cuda || is_device_pointer(query_offset.data)) {
      c.fail("query_offset", "host memory (the cuda backend does not take query offsets yet)", "device memory",
             status_code::unsupported);
      return;
    }
    for (std::int64_t b = 0; b < p.batch; ++b) {
      const std::int64_t off = b * query_offset.stride[0];
      const std::int64_t q0 = query_offset.type == dtype::i32
                                  ? static_cast<const std::int32_t*>(query_offset.data)[off]
                                  : static_cast<const std::int64_t*>(query_offset.data)[off];
      if (q0 < 0 || q0 > kMaxPosition - p.seqlen_q) {
        c.fail("query_offset", "values in [0, " + std::to_string(kMaxPosition - p.seqlen_q) + "] (global positions)",
               std::to_string(q0) + " at index " + std::to_string(b));
        return;
      }
    }
    p.query_offset = query_offset.data;
    p.query_offset_type = query_offset.type;
    p.query_offset_stride = query_offset.stride[0];
  }
}

/// Output element type rule: q's type, or f32 for 16-bit q.
void check_output_type(checker& c, const char* name, const tensor_view& t, dtype in) {
  if (c.failed()) return;
  const bool ok = t.type == in || ((in == dtype::f16 || in == dtype::bf16) && t.type == dtype::f32);
  if (!ok) {
    c.fail(name, std::string("element type ") + dtype_name(in) +
                     (in == dtype::f16 || in == dtype::bf16 ? " or f32" : ""),
           dtype_name(t.type));
  }
}

void check_same_shape(checker& c, const char* name, const tensor_view& t, const char* ref_name,
                      const tensor_view& ref) {
  for (int d = 0; d < ref.rank && !c.failed(); ++d) {
    if (t.shape[d] != ref.shape[d]) {
      c.fail(name, std::string("the shape of '") + ref_name + "' " + shape_str(ref), shape_str(t));
    }
  }
}

void check_lse(checker& c, const tensor_view& lse, const attention_params& p) {
  if (!check_view(c, "lse", lse, 3)) return;
  check_type(c, "lse", lse, p.lse_type);
  check_dim(c, "lse", lse, 0, "batch", p.batch);
  check_dim(c, "lse", lse, 1, "heads", p.heads);
  check_dim(c, "lse", lse, 2, "seqlen_q", p.seqlen_q);
}

/// The three-stage pipeline's optional compressed outputs (values and indices together, with equal
/// strides; metadata only for the hardware patterns 1:2 and 2:4).
void check_compressed(checker& c, const forward_args& a, const attention_config& config,
                      const attention_params& p, std::vector<named_view>& outputs) {
  const bool vals = a.compressed_values.present(), idx = a.compressed_indices.present();
  const bool meta = a.compressed_meta.present();
  if (c.failed() || (!vals && !idx && !meta)) return;
  const char* first = vals ? "compressed_values" : (idx ? "compressed_indices" : "compressed_meta");
  if (config.cpu_algorithm != cpu_algorithm::three_stage || config.backend == backend::reference ||
      config.backend == backend::cuda) {
    c.fail(first, "to be absent unless config.cpu_algorithm is three_stage on the cpu backend", "a view");
    return;
  }
  if (vals != idx) {
    c.fail(vals ? "compressed_indices" : "compressed_values",
           "to be given together with the other of compressed_values / compressed_indices", "nothing");
    return;
  }
  const std::int64_t groups = (p.seqlen_k + p.pattern_m - 1) / p.pattern_m;
  if (vals) {
    if (!check_view(c, "compressed_values", a.compressed_values, 4)) return;
    check_type(c, "compressed_values", a.compressed_values, dtype::f32);
    const std::int64_t want[4] = {p.batch, p.heads, p.seqlen_q, groups * p.pattern_n};
    const char* names[4] = {"batch", "heads", "seqlen_q", "kept per row = ceil(Lk / M) * N"};
    for (int d = 0; d < 4; ++d) check_dim(c, "compressed_values", a.compressed_values, d, names[d], want[d]);
    if (!check_view(c, "compressed_indices", a.compressed_indices, 4)) return;
    check_type(c, "compressed_indices", a.compressed_indices, dtype::i32);
    check_same_shape(c, "compressed_indices", a.compressed_indices, "compressed_values", a.compressed_values);
    for (int d = 0; d < 4 && !c.failed(); ++d) {
      if (a.compressed_indices.stride[d] != a.compressed_values.stride[d]) {
        c.fail("compressed_indices", "the strides of 'compressed_values'",
               "stride[" + std::to_string(d) + "] = " + std::to_string(a.compressed_indices.stride[d]));
      }
    }
    outputs.push_back({"compressed_values", &a.compressed_values});
    outputs.push_back({"compressed_indices", &a.compressed_indices});
  }
  if (meta) {
    const bool hw = (p.pattern_n == 1 && p.pattern_m == 2) || (p.pattern_n == 2 && p.pattern_m == 4);
    if (!hw) {
      c.fail("compressed_meta", "pattern 1:2 or 2:4 (sparse tensor core metadata)",
             "pattern " + std::to_string(p.pattern_n) + ":" + std::to_string(p.pattern_m));
      return;
    }
    if (!check_view(c, "compressed_meta", a.compressed_meta, 4)) return;
    check_type(c, "compressed_meta", a.compressed_meta, dtype::u16);
    const std::int64_t want[4] = {p.batch, p.heads, p.seqlen_q, (p.seqlen_k + 15) / 16};
    const char* names[4] = {"batch", "heads", "seqlen_q", "words per row = ceil(Lk / 16)"};
    for (int d = 0; d < 4; ++d) check_dim(c, "compressed_meta", a.compressed_meta, d, names[d], want[d]);
    outputs.push_back({"compressed_meta", &a.compressed_meta});
  }
}

}  // namespace

status build_forward_params(const forward_args& a, const attention_config& config, const char* op,
                            attention_params& p) {
  checker c(op);
  p = attention_params{};
  check_common(c, a.q, a.k, a.v, a.bias, a.key_lengths, a.query_offset, config, p);
  if (check_view(c, "out", a.out, 4)) {
    check_same_shape(c, "out", a.out, "q", a.q);
    check_output_type(c, "out", a.out, p.input_type);
  }
  std::vector<named_view> outputs{{"out", &a.out}};
  if (a.lse.present()) {
    check_lse(c, a.lse, p);
    outputs.push_back({"lse", &a.lse});
  }
  check_compressed(c, a, config, p, outputs);
  if (c.failed()) return c.result();
  std::vector<named_view> inputs{{"q", &a.q}, {"k", &a.k}, {"v", &a.v}};
  if (a.bias.present()) inputs.push_back({"bias", &a.bias});
  if (a.key_lengths.present()) inputs.push_back({"key_lengths", &a.key_lengths});
  if (a.query_offset.present()) inputs.push_back({"query_offset", &a.query_offset});
  check_outputs(c, outputs, inputs);
  if (c.failed()) return c.result();

  p.output_type = a.out.type;
  p.o_type = a.out.type;
  p.o = a.out.data;
  copy_strides(a.out, p.o_stride, 4);
  if (a.lse.present()) {
    p.lse = a.lse.data;
    copy_strides(a.lse, p.lse_stride, 3);
  }
  if (a.compressed_values.present()) {
    p.compressed_values = static_cast<float*>(a.compressed_values.data);
    p.compressed_indices = static_cast<std::int32_t*>(a.compressed_indices.data);
    copy_strides(a.compressed_values, p.compressed_stride, 4);
  }
  if (a.compressed_meta.present()) {
    p.compressed_meta = static_cast<std::uint16_t*>(a.compressed_meta.data);
    copy_strides(a.compressed_meta, p.compressed_meta_stride, 4);
  }
  return status::success();
}

status build_backward_params(const backward_args& a, const attention_config& config, const char* op,
                             attention_params& p) {
  checker c(op);
  p = attention_params{};
  check_common(c, a.q, a.k, a.v, a.bias, a.key_lengths, a.query_offset, config, p);
  if (check_view(c, "dout", a.dout, 4)) {
    check_same_shape(c, "dout", a.dout, "q", a.q);
    check_type(c, "dout", a.dout, p.input_type);
  }
  if (a.out.present() && check_view(c, "out", a.out, 4)) {
    check_same_shape(c, "out", a.out, "q", a.q);
    check_output_type(c, "out", a.out, p.input_type);
  }
  if (a.lse.present()) check_lse(c, a.lse, p);
  if (a.dlse.present()) {
    if (!a.lse.present() || !a.out.present()) {
      c.fail("dlse", "to be given with the forward's 'out' and 'lse' (a gradient of an LSE the call would recompute)",
             "a view without them");
    } else if (check_view(c, "dlse", a.dlse, 3)) {
      check_same_shape(c, "dlse", a.dlse, "lse", a.lse);
      check_type(c, "dlse", a.dlse, p.lse_type);
    }
  }
  if (check_view(c, "dq", a.dq, 4)) {
    check_same_shape(c, "dq", a.dq, "q", a.q);
    check_output_type(c, "dq", a.dq, p.input_type);
  }
  if (check_view(c, "dk", a.dk, 4)) {
    check_same_shape(c, "dk", a.dk, "k", a.k);
    check_type(c, "dk", a.dk, a.dq.type);
  }
  if (check_view(c, "dv", a.dv, 4)) {
    check_same_shape(c, "dv", a.dv, "v", a.v);
    check_type(c, "dv", a.dv, a.dq.type);
  }
  if (a.dbias.present()) {
    if (!a.bias.present()) {
      c.fail("dbias", "to be absent when no 'bias' is given", "a view");
    } else if (check_view(c, "dbias", a.dbias, 4)) {
      check_same_shape(c, "dbias", a.dbias, "bias", a.bias);
      check_type(c, "dbias", a.dbias, a.bias.type);
    }
  }
  if (c.failed()) return c.result();

  std::vector<named_view> outputs{{"dq", &a.dq}, {"dk", &a.dk}, {"dv", &a.dv}};
  if (a.dbias.present()) outputs.push_back({"dbias", &a.dbias});
  std::vector<named_view> inputs{{"q", &a.q}, {"k", &a.k}, {"v", &a.v}, {"dout", &a.dout}};
  if (a.out.present()) inputs.push_back({"out", &a.out});
  if (a.lse.present()) inputs.push_back({"lse", &a.lse});
  if (a.dlse.present()) inputs.push_back({"dlse", &a.dlse});
  if (a.bias.present()) inputs.push_back({"bias", &a.bias});
  if (a.key_lengths.present()) inputs.push_back({"key_lengths", &a.key_lengths});
  if (a.query_offset.present()) inputs.push_back({"query_offset", &a.query_offset});
  check_outputs(c, outputs, inputs);
  if (c.failed()) return c.result();

  p.output_type = a.dq.type;
  p.dout = a.dout.data;
  copy_strides(a.dout, p.dout_stride, 4);
  if (a.out.present()) {
    p.o = a.out.data;
    p.o_type = a.out.type;
    copy_strides(a.out, p.o_stride, 4);
  }
  if (a.lse.present()) {
    p.lse = a.lse.data;
    copy_strides(a.lse, p.lse_stride, 3);
  }
  if (a.dlse.present()) {
    p.dlse = a.dlse.data;
    copy_strides(a.dlse, p.dlse_stride, 3);
  }
  p.dq = a.dq.data;
  copy_strides(a.dq, p.dq_stride, 4);
  p.dk = a.dk.data;
  copy_strides(a.dk, p.dk_stride, 4);
  p.dv = a.dv.data;
  copy_strides(a.dv, p.dv_stride, 4);
  if (a.dbias.present()) {
    p.dbias = a.dbias.data;
    copy_strides(a.dbias, p.dbias_stride, 4);
  }
  return status::success();
}

namespace {

/// Views that are the same tensor: pointer, type, shape and strides all equal (the one overlap the
/// merge allows: an in-place update of part a).
bool same_view(const tensor_view& a, const tensor_view& b) {
  if (a.data != b.data || a.type != b.type || a.rank != b.rank) return false;
  for (int d = 0; d < a.rank; ++d) {
    if (a.shape[d] != b.shape[d] || (a.shape[d] > 1 && a.stride[d] != b.stride[d])) return false;
  }
  return true;
}

}  // namespace

status build_merge_params(const merge_args& a, int num_threads, const char* op, merge_params& p) {
  checker c(op);
  if (!check_view(c, "out_a", a.out_a, 4)) return c.result();
  const dtype ot = a.out_a.type;
  if (ot != dtype::f64 && ot != dtype::f32 && ot != dtype::f16 && ot != dtype::bf16) {
    c.fail("out_a", "element type f64, f32, f16 or bf16", dtype_name(ot));
    return c.result();
  }
  const dtype lt = ot == dtype::f64 ? dtype::f64 : dtype::f32;
  for (const named_view& v : {named_view{"out_b", &a.out_b}, named_view{"out", &a.out}}) {
    if (!check_view(c, v.name, *v.view, 4)) return c.result();
    check_type(c, v.name, *v.view, ot);
    check_same_shape(c, v.name, *v.view, "out_a", a.out_a);
  }
  for (const named_view& v : {named_view{"lse_a", &a.lse_a}, named_view{"lse_b", &a.lse_b}, named_view{"lse", &a.lse}}) {
    if (!check_view(c, v.name, *v.view, 3)) return c.result();
    check_type(c, v.name, *v.view, lt);
    check_dim(c, v.name, *v.view, 0, "batch, out_a's shape[0]", a.out_a.shape[0]);
    check_dim(c, v.name, *v.view, 1, "heads, out_a's shape[2]", a.out_a.shape[2]);
    check_dim(c, v.name, *v.view, 2, "rows, out_a's shape[1]", a.out_a.shape[1]);
  }
  if (num_threads < 0 || num_threads > kMaxThreads) {
    c.fail("num_threads", "a count in [0, " + std::to_string(kMaxThreads) + "] (0: all hardware threads)",
           std::to_string(num_threads));
  }
  if (c.failed()) return c.result();
  // Outputs: disjoint from everything, except that out may be exactly out_a and lse exactly lse_a.
  std::vector<named_view> inputs{{"out_b", &a.out_b}, {"lse_b", &a.lse_b}};
  if (!same_view(a.out, a.out_a)) inputs.push_back({"out_a", &a.out_a});
  if (!same_view(a.lse, a.lse_a)) inputs.push_back({"lse_a", &a.lse_a});
  // An in-place output still must not overlap the other part's arguments or the other output.
  std::vector<named_view> outputs{{"out", &a.out}, {"lse", &a.lse}};
  check_outputs(c, outputs, inputs);
  if (same_view(a.out, a.out_a) && !c.failed() && may_overlap(a.out, a.lse_a)) {
    c.fail("out", "memory disjoint from input 'lse_a'", "an overlapping buffer");
  }
  if (same_view(a.lse, a.lse_a) && !c.failed() && may_overlap(a.lse, a.out_a)) {
    c.fail("lse", "memory disjoint from input 'out_a'", "an overlapping buffer");
  }
  if (c.failed()) return c.result();
  p = merge_params{};
  p.batch = a.out_a.shape[0];
  p.seqlen = a.out_a.shape[1];
  p.heads = a.out_a.shape[2];
  p.head_dim = a.out_a.shape[3];
  p.out_type = ot;
  p.lse_type = lt;
  p.out_a = a.out_a.data;
  p.out_b = a.out_b.data;
  p.out = a.out.data;
  p.lse_a = a.lse_a.data;
  p.lse_b = a.lse_b.data;
  p.lse = a.lse.data;
  copy_strides(a.out_a, p.out_a_stride, 4);
  copy_strides(a.out_b, p.out_b_stride, 4);
  copy_strides(a.out, p.out_stride, 4);
  copy_strides(a.lse_a, p.lse_a_stride, 3);
  copy_strides(a.lse_b, p.lse_b_stride, 3);
  copy_strides(a.lse, p.lse_stride, 3);
  p.num_threads = num_threads;
  return c.result();
}

}  // namespace dfss::core
