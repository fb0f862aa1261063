// `dfss bench --decode`: one decode step (Lq query rows, 1 by default) against a KV cache of Lk keys,
// B = 1, d = 128, for grouped heads (--decode-heads H:Hkv, default MHA 32:32 and GQA 32:8) and cache
// types (--decode-dtypes, default f32 and bf16). Rows: dfss dense, DFSS 1:2 and 2:4 (the selector's
// decode kernel), PyTorch 2.x SDPA on a cache of the same shape, type and layout
// (tools/bench/torch_decode.py --serve, a co-process with the same threads: sdpa_peer), and the
// machine's memory bandwidth: a read-only sweep over the cache's K and V with the same threads. All
// rows of a configuration, SDPA's included, are timed round-robin (one call of each in turn, --iters
// times) so that they see the same machine, every timed call after a read of kFlushBytes elsewhere
// so that each one reads the cache from memory.
//
// --rounds R repeats the whole sweep (every configuration) R times and reports the median of each
// row's round medians and of each of its per-round ratios, as the forward's --rounds does.
//
// The cache is laid out [B, Hkv, Lk, d] (Hugging Face's KV cache, SDPA's layout); dfss reads it
// through strided [B, Lk, Hkv, d] views, no copy. The causal flag is set (bottom-right: a no-op for
// Lq = 1, the draft rows of speculative decoding for Lq > 1); SDPA gets is_causal=False for Lq = 1 and
// the bottom-right mask explicitly for Lq > 1 (its is_causal is top-left), with enable_gqa=True.
// GB/s = dense K + V bytes / median time, for every row (so for the sparse rows it is a
// dense-equivalent rate: they read all of K but only the kept rows of V).
//
// The sweep reads the cache itself (the bytes of K, then of V, each thread a contiguous share), so
// that it measures the rate at which this machine reads the very memory the decode reads. A second
// sweep, over a buffer of the same size allocated after the cache, is kept as a row for the record:
// on the 2-core Zen 4 machine of docs/benchmarks.md, of six identical buffers swept round-robin in
// one process the first allocated read 10-30% slower than the others, in every run and in either
// sweep order, so a yardstick on other memory than the cache's can be off by that much. A third
// sweep reads all of K and one random row of every two of V (sweep_half), the least a 1:2 step
// reads: on the Zen 3 machine it took longer than the whole cache's sweep (the hardware prefetchers
// fetch the rows between), which is why 1:2 decode is no faster than dense there.
#include <omp.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "cli/bench/bench.hpp"
#include "cli/commands.hpp"
#include "npy/files.hpp"

namespace dfss::cli::bench {
namespace {

/// Bytes read before every timed call (a sweep or a dfss row) to push the cache out of the CPU's
/// caches: a decode step reads each layer's cache once per token, from memory, while a cache of
/// 16-128 MiB (4096 keys) timed right after the previous call would be read partly from the last
/// level (32 MiB on the Zen 3 and Zen 4 parts we run on; a cache sweep timed right after the dfss
/// rows read a 16 MiB cache at 63 against 29 GB/s). Four times that, so that it is gone.
constexpr std::size_t kFlushBytes = std::size_t{128} << 20;

/// Longest cache checked against the fp64 reference: its copy of K and V in fp64 is 4x the fp32 cache
/// (2 GiB at Lk = 16384 with 32 kv heads), and longer caches add no new code path.
constexpr long long kDecodeRefKeys = 16384;

/// The yardstick row (a sweep of the cache itself), the sweep of another buffer beside it, and the
/// floor of a 1:2 step: all of K and one row of every two of V (sweep_half).
constexpr const char* kSweepRow = "memory sweep";
constexpr const char* kOtherSweepRow = "memory sweep, other";
constexpr const char* kHalfSweepRow = "memory sweep, K + half V";

/// Whether @p what is one of the sweep rows (yardsticks: their only ratio is to the cache's sweep).
bool is_sweep_row(const std::string& what) { return what.rfind(kSweepRow, 0) == 0; }

struct decode_config {
  long long lk = 0, heads = 0, heads_kv = 0;
  std::string dtype;  // f32, bf16, f16
};

struct decode_row {
  decode_config c;
  std::string what;    // "dfss dense", "dfss 1:2", "torch 2.x sdpa", "memory sweep"
  std::string kernel;  // selector name, interpreter, or "-"
  bool ok = false;
  std::string reason;
  stats ms;
  int iters = 0;
  double gbs = kNaN, of_bandwidth = kNaN, vs_sdpa = kNaN, vs_dense = kNaN, max_err = kNaN;
  /// With --rounds: each round's median and ratios (the row's own are their medians).
  std::vector<double> round_ms, round_of_bandwidth, round_vs_sdpa, round_vs_dense;
};

/// "H:Hkv" -> (H, Hkv).
std::pair<long long, long long> parse_heads(const std::string& s) {
  const auto colon = s.find(':');
  long long h = 0, hkv = 0;
  try {
    if (colon == std::string::npos) throw std::invalid_argument(s);
    h = std::stoll(s.substr(0, colon));
    hkv = std::stoll(s.substr(colon + 1));
  } catch (const std::exception&) {
    h = hkv = 0;
  }
  if (h < 1 || hkv < 1 || h % hkv != 0) {
    throw error(status_code::invalid_argument,
                "dfss bench: argument '--decode-heads': expected H:Hkv with Hkv dividing H, got '" + s + "'");
  }
  return {h, hkv};
}

/// A part of the memory a sweep reads: its first byte and its whole 64-bit words.
struct sweep_part {
  const unsigned char* bytes;
  std::size_t words;
};

/// The 64-bit word @p i of @p p (memcpy: the bytes may hold floats; compiled to one load).
inline std::uint64_t word_at(const unsigned char* p, std::size_t i) {
  std::uint64_t w;
  std::memcpy(&w, p + i * 8, sizeof w);
  return w;
}

/// Sums of 64-bit words in four independent accumulators, so that a sweep is bound by its loads,
/// not by an add chain.
struct word_sums {
  std::uint64_t a = 0, b = 0, c = 0, d = 0;
  /// Adds words [i, last) of @p bytes.
  void add(const unsigned char* bytes, std::size_t i, std::size_t last) {
    for (; i + 4 <= last; i += 4) {
      a += word_at(bytes, i);
      b += word_at(bytes, i + 1);
      c += word_at(bytes, i + 2);
      d += word_at(bytes, i + 3);
    }
    for (; i < last; ++i) a += word_at(bytes, i);
  }
  std::uint64_t total() const { return a + b + c + d; }
};

/// The read-only sweep: the parts' words in order, every thread summing its contiguous share.
std::uint64_t sweep(const std::vector<sweep_part>& parts, int threads) {
  std::size_t n = 0;
  for (const auto& p : parts) n += p.words;
  std::uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const std::size_t t = static_cast<std::size_t>(omp_get_thread_num());
    const std::size_t nt = static_cast<std::size_t>(omp_get_num_threads());
    const std::size_t begin = n * t / nt, end = n * (t + 1) / nt;
    word_sums sums;
    std::size_t first = 0;  // the part's first word in the whole
    for (const auto& p : parts) {
      // This thread's words of the part: [lo, hi) of the whole, [lo - first, hi - first) of the part.
      const std::size_t lo = std::max(begin, first), hi = std::min(end, first + p.words);
      if (hi > lo) sums.add(p.bytes, lo - first, hi - first);
      first += p.words;
    }
    total += sums.total();
  }
  return total;
}

/// What a 1:2 step must read at least: the words of @p whole (K), then of @p rows (V, rows of
/// @p row_words words) one row of every two consecutive ones, row 2 p + pick[p] (a last odd row
/// whole), every thread a contiguous share of both, in address order. Against the sweep of the
/// whole cache it bounds what skipping V rows can gain on this machine: the hardware prefetchers
/// may fetch the rows between the ones read.
std::uint64_t sweep_half(const sweep_part& whole, const sweep_part& rows, std::size_t row_words,
                         const std::vector<unsigned char>& pick, int threads) {
  const std::size_t n_rows = rows.words / row_words, pairs = (n_rows + 1) / 2;
  std::uint64_t total = 0;
#pragma omp parallel num_threads(threads) reduction(+ : total)
  {
    const std::size_t t = static_cast<std::size_t>(omp_get_thread_num());
    const std::size_t nt = static_cast<std::size_t>(omp_get_num_threads());
    word_sums sums;
    sums.add(whole.bytes, whole.words * t / nt, whole.words * (t + 1) / nt);
    for (std::size_t p = pairs * t / nt; p < pairs * (t + 1) / nt; ++p) {
      const std::size_t row = std::min(2 * p + pick[p], n_rows - 1);
      sums.add(rows.bytes, row * row_words, (row + 1) * row_words);
    }
    total += sums.total();
  }
  return total;
}

/// PyTorch 2.x SDPA on the same cache shape: tools/bench/torch_decode.py --serve as a co-process
/// (torch_server, one for the whole run), told to set up each configuration and to time one call at
/// a time, so that its calls are timed round-robin with the dfss rows and the sweeps. Until
/// 2026-12-05 SDPA ran in a child after all dfss rows of a round, on a host that had moved on by
/// then (a busy host once took SDPA to 5-12x its usual time: docs/benchmarks.md).
class sdpa_peer {
 public:
  /// Starts the co-process of the last torch 2.x interpreter of --python; where there is none, or
  /// it does not answer, the reason goes to @p notes and alive() is false.
  explicit sdpa_peer(std::vector<std::string>& notes) {
    std::vector<std::string> peer_notes;
    const std::vector<torch_peer> peers = probe_torch_peers(peer_notes);
    const torch_peer* peer = nullptr;
    for (const auto& p : peers)
      if (has_public_sdpa(p)) peer = &p;
    for (const auto& n : peer_notes) notes.push_back(n);
    if (peer == nullptr) {
      notes.push_back("torch: no torch 2.x interpreter among --python: no SDPA rows");
      return;
    }
    std::string script = find_torch_script();
    script = script.substr(0, script.rfind('/')) + "/torch_decode.py";
    std::ostringstream args;
    args << "--batch " << g_opt.batch << " --query-rows " << g_opt.query_rows << " --head-dim " << g_opt.head_dim
         << " --threads " << g_opt.threads << " --seed " << g_opt.seed << " --cache-layout " << g_opt.cache_layout
         << " --ref-max-keys " << kDecodeRefKeys;
    log_stderr("  torch %s (%s): SDPA decode, a co-process\n", peer->version.c_str(), peer->python.c_str());
    server_ = std::make_unique<torch_server>(*peer, script, args.str());
    if (!server_->alive()) {
      notes.push_back("torch " + peer->version + ": the decode script did not start (" + server_->why() +
                      "); run it by hand: " + server_->command());
      server_.reset();
      return;
    }
    name_ = "torch " + peer->version + " sdpa";
    notes.push_back("torch " + peer->version + " (" + peer->python + "), timed round-robin with the dfss rows: " +
                    server_->command());
  }
  bool alive() const { return server_ != nullptr && server_->alive(); }
  /// Whether it started (then name() is its row's name), alive or not since.
  bool started() const { return !name_.empty(); }
  const std::string& name() const { return name_; }
  const std::string& command() const { return server_->command(); }
  json ask(const json& req) { return server_->ask(req); }

 private:
  std::string name_;
  std::unique_ptr<torch_server> server_;
};

/// Memory that the SDPA co-process maps too: a configuration's q, K and V, so that SDPA reads the
/// very pages dfss and the sweeps read, with the same values. With its own copy SDPA read another
/// part of memory, at another rate (Sapphire Rapids VM, MHA fp32 at 16384 keys, one run: SDPA at
/// 131% of the cache's sweep, dfss at 114%; the "memory sweep, other" row shows such differences
/// between buffers). An anonymous memfd (no file left behind), which the
/// child opens as /proc/<pid>/fd/<fd>; not ok() where it cannot be made (then SDPA gets a copy).
class shared_cache {
 public:
  explicit shared_cache(std::size_t bytes) : bytes_(bytes) {
    fd_ = static_cast<int>(memfd_create("dfss-bench-decode-cache", MFD_CLOEXEC));  // opened by path, not inherited
    if (fd_ < 0) return;
    if (ftruncate(fd_, static_cast<off_t>(bytes)) != 0) return;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd_, 0);
    if (p != MAP_FAILED) data_ = static_cast<unsigned char*>(p);
  }
  ~shared_cache() {
    if (data_ != nullptr) munmap(data_, bytes_);
    if (fd_ >= 0) close(fd_);
  }
  shared_cache(const shared_cache&) = delete;
  shared_cache& operator=(const shared_cache&) = delete;
  bool ok() const { return data_ != nullptr; }
  unsigned char* data() const { return data_; }
  std::string path() const { return "/proc/" + std::to_string(getpid()) + "/fd/" + std::to_string(fd_); }

 private:
  std::size_t bytes_;
  int fd_ = -1;
  unsigned char* data_ = nullptr;
};

/// @p n rounded up to a whole number of 4 KiB pages (each tensor of shared_cache starts on a page).
std::size_t page_round(std::size_t n) { return (n + 4095) / 4096 * 4096; }

/// The dfss rows, the memory sweeps and SDPA (@p sdpa, when alive) of one configuration, timed
/// round-robin.
void bench_decode_config(const decode_config& c, std::vector<decode_row>& rows, sdpa_peer* sdpa) {
  const std::int64_t B = g_opt.batch, Lq = g_opt.query_rows, d = g_opt.head_dim;
  const std::int64_t H = c.heads, Hkv = c.heads_kv, Lk = c.lk;
  const dtype type = parse_dtype(c.dtype);
  const auto kv_n = static_cast<std::size_t>(B * Hkv * Lk * d);
  std::mt19937_64 rng(g_opt.seed + static_cast<unsigned long long>(Lk * 131 + Hkv));
  input_tensor q, k, v;
  log_stderr("  Lk=%lld H=%lld Hkv=%lld %s: drawing the cache\n", c.lk, c.heads, c.heads_kv, c.dtype.c_str());
  q.fill(static_cast<std::size_t>(B * Lq * H * d), type, rng);
  k.fill(kv_n, type, rng);
  v.fill(kv_n, type, rng);
  // q, K and V where SDPA's co-process maps them too (shared_cache), else where they were drawn.
  const std::size_t q_at = 0, k_at = page_round(q.bytes()), v_at = k_at + page_round(k.bytes()),
                    o_at = v_at + page_round(v.bytes());  // SDPA's output, fp32 [B, Lq, H, d]
  const bool with_sdpa = sdpa != nullptr && sdpa->alive();
  std::unique_ptr<shared_cache> shared;
  if (with_sdpa) shared = std::make_unique<shared_cache>(o_at + static_cast<std::size_t>(B * Lq * H * d) * 4);
  const void* q_data = q.data();
  const void* k_data = k.data();
  const void* v_data = v.data();
  if (shared != nullptr && shared->ok()) {
    std::memcpy(shared->data() + q_at, q.data(), q.bytes());
    std::memcpy(shared->data() + k_at, k.data(), k.bytes());
    std::memcpy(shared->data() + v_at, v.data(), v.bytes());
    q_data = shared->data() + q_at;
    k_data = shared->data() + k_at;
    v_data = shared->data() + v_at;
  }
  // [B, Hkv, Lk, d] memory seen as [B, Lk, Hkv, d] (bhld), or [B, Lk, Hkv, d] memory (blhd).
  const bool blhd = g_opt.cache_layout == "blhd";
  const auto strided = [&](auto* data) {
    return blhd ? make_view(data, {B, Lk, Hkv, d}) : make_strided_view(data, {B, Lk, Hkv, d}, {Hkv * Lk * d, d, Lk * d, 1});
  };
  const auto cache_view = [&](const void* x) {
    switch (type) {
      case dtype::f16: return strided(static_cast<const half*>(x));
      case dtype::bf16: return strided(static_cast<const bfloat16*>(x));
      default: return strided(static_cast<const float*>(x));
    }
  };
  forward_args a;
  switch (type) {
    case dtype::f16: a.q = make_view(static_cast<const half*>(q_data), {B, Lq, H, d}); break;
    case dtype::bf16: a.q = make_view(static_cast<const bfloat16*>(q_data), {B, Lq, H, d}); break;
    default: a.q = make_view(static_cast<const float*>(q_data), {B, Lq, H, d}); break;
  }
  a.k = cache_view(k_data);
  a.v = cache_view(v_data);
  const double kv_bytes = static_cast<double>(k.bytes() + v.bytes());

  // The yardstick sweeps the cache's own K and V; the other buffer (the size of K + V, written
  // once so that its pages are faulted in) is swept beside it for the record (see the top).
  const std::vector<sweep_part> cache_parts = {
      {static_cast<const unsigned char*>(k_data), k.bytes() / 8},
      {static_cast<const unsigned char*>(v_data), v.bytes() / 8}};
  std::vector<std::uint64_t> buffer(static_cast<std::size_t>(kv_bytes) / 8);
  for (std::size_t i = 0; i < buffer.size(); ++i) buffer[i] = i * 0x9E3779B97F4A7C15ull;
  const std::vector<sweep_part> buffer_parts = {
      {reinterpret_cast<const unsigned char*>(buffer.data()), buffer.size()}};
  // The 1:2 floor's rows of V: one of every two, at random (K and V rows are d values; a row's
  // words are whole for every cache type at d a multiple of 4, else the floor's rows are rounded).
  const std::size_t row_words = std::max<std::size_t>(1, static_cast<std::size_t>(d) * (k.bytes() / kv_n) / 8);
  std::vector<unsigned char> pick((v.bytes() / 8 / row_words + 1) / 2);
  for (auto& x : pick) x = static_cast<unsigned char>(rng() & 1);
  std::vector<std::uint64_t> flush(kFlushBytes / 8);
  for (std::size_t i = 0; i < flush.size(); ++i) flush[i] = i;
  const std::vector<sweep_part> flush_parts = {{reinterpret_cast<const unsigned char*>(flush.data()), flush.size()}};
  std::uint64_t sink = 0;

  struct run {
    decode_row r;
    attention_config cfg;
    input_tensor out;  // O, in output_dtype
    std::vector<double> ms;
  };
  std::vector<std::unique_ptr<run>> runs;
  for (const auto& pat : g_opt.patterns) {
    auto s = std::make_unique<run>();
    s->cfg.pattern = pattern::parse(pat, "--patterns");
    s->cfg.backend = backend::cpu;
    s->cfg.causal = true;
    s->cfg.num_threads = g_opt.threads;
    s->cfg.cpu_isa = parse_cpu_isa(g_opt.isas.at(0), "--isa");
    s->r.c = c;
    s->r.what = "dfss " + s->cfg.pattern.str();
    s->out.assign(static_cast<std::size_t>(B * Lq * H * d), output_dtype(type), 0.0f);
    a.out = s->out.view(B, Lq, H, d);
    const kernel_selection sel = select_kernel(a, s->cfg);
    s->r.kernel = sel.supported() ? sel.name : "-";
    if (!sel.supported()) {
      s->r.reason = sel.reason;
    } else {
      const status st = try_attention_forward(a, s->cfg);  // warmup
      s->r.ok = st.ok();
      s->r.reason = st.message;
    }
    runs.push_back(std::move(s));
  }
  // SDPA's row: set up in the co-process, on the same memory (shared_cache) or, where that could
  // not be made, on a cache of its own drawn alike.
  decode_row sdpa_row;
  std::vector<double> sdpa_ms;
  double sdpa_kv_bytes = kNaN;
  if (with_sdpa) {
    sdpa_row.c = c;
    sdpa_row.what = sdpa->name();
    json setup = {{"cmd", "setup"}, {"Lk", c.lk}, {"H", c.heads}, {"Hkv", c.heads_kv}, {"dtype", dtype_label(c.dtype)}};
    if (shared->ok()) setup["shared"] = {{"file", shared->path()}, {"q", q_at}, {"k", k_at}, {"v", v_at}, {"out", o_at}};
    const json ready = sdpa->ask(setup);
    sdpa_row.kernel = ready.contains("method") ? get_str(ready, "method") : "-";
    if (ready.contains("error")) {
      sdpa_row.reason = get_str(ready, "error");
    } else {
      sdpa_row.ok = true;
      sdpa_kv_bytes = get_num(ready, "kv_bytes");
    }
  }
  std::vector<double> sweep_ms, buffer_ms, half_ms;
  sink += sweep(cache_parts, g_opt.threads);  // warmup
  sink += sweep(buffer_parts, g_opt.threads);
  sink += sweep_half(cache_parts[0], cache_parts[1], row_words, pick, g_opt.threads);
  const int rounds = g_opt.iters;
  for (int it = 0; it < rounds; ++it) {
    g_progress.show(g_rows_done + 1, static_cast<int>(runs.size()) + 1 + (with_sdpa ? 1 : 0),
                    "Lk=" + std::to_string(c.lk) + " " + std::to_string(c.heads) + ":" + std::to_string(c.heads_kv) +
                        " " + c.dtype + ": round " + std::to_string(it + 1) + " of " + std::to_string(rounds));
    sink += sweep(flush_parts, g_opt.threads);
    auto t0 = std::chrono::steady_clock::now();
    sink += sweep(cache_parts, g_opt.threads);
    sweep_ms.push_back(elapsed_ms(t0));
    sink += sweep(flush_parts, g_opt.threads);
    t0 = std::chrono::steady_clock::now();
    sink += sweep(buffer_parts, g_opt.threads);
    buffer_ms.push_back(elapsed_ms(t0));
    sink += sweep(flush_parts, g_opt.threads);
    t0 = std::chrono::steady_clock::now();
    sink += sweep_half(cache_parts[0], cache_parts[1], row_words, pick, g_opt.threads);
    half_ms.push_back(elapsed_ms(t0));
    for (auto& s : runs) {
      if (!s->r.ok) continue;
      a.out = s->out.view(B, Lq, H, d);
      sink += sweep(flush_parts, g_opt.threads);
      t0 = std::chrono::steady_clock::now();
      const status st = try_attention_forward(a, s->cfg);
      s->ms.push_back(elapsed_ms(t0));
      if (!st.ok()) {
        s->r.ok = false;
        s->r.reason = st.message;
      }
    }
    if (sdpa_row.ok) {
      const json t = sdpa->ask({{"cmd", "time"}});
      if (t.contains("error")) {
        sdpa_row.ok = false;
        sdpa_row.reason = get_str(t, "error");
      } else {
        sdpa_ms.push_back(get_num(t, "ms"));
      }
      hand_off();
    }
  }
  g_rows_done += static_cast<int>(runs.size()) + 1 + (with_sdpa ? 1 : 0);

  // GB/s of every sweep row is K + V bytes / time, like the dfss rows' (dense-equivalent for the
  // half sweep); the kernel column says what it read.
  const auto sweep_row = [&](const char* what, const std::vector<double>& ms, double read_bytes) {
    decode_row bw;
    bw.c = c;
    bw.what = what;
    bw.kernel = "read " + std::to_string(static_cast<long long>(read_bytes / 1048576.0)) + " MiB (checksum " +
                std::to_string(sink % 1000) + ")";
    bw.ok = true;
    bw.ms = summarize(ms);
    bw.iters = static_cast<int>(ms.size());
    bw.gbs = kv_bytes / (bw.ms.median * 1e6);
    rows.push_back(bw);
  };
  sweep_row(kSweepRow, sweep_ms, kv_bytes);
  sweep_row(kOtherSweepRow, buffer_ms, kv_bytes);
  sweep_row(kHalfSweepRow, half_ms, static_cast<double>(k.bytes() + pick.size() * row_words * 8));  // a row per pair

  // fp64 reference of every output (Lq rows are few), for caches up to kDecodeRefKeys keys.
  const bool check = !g_opt.no_ref && Lk <= kDecodeRefKeys;
  std::vector<double> qd, kd, vd;
  if (check) {
    qd.resize(static_cast<std::size_t>(B * Lq * H * d));
    for (std::size_t i = 0; i < qd.size(); ++i) qd[i] = q.at(i);
    kd.resize(kv_n);
    vd.resize(kv_n);
    for (std::size_t i = 0; i < kv_n; ++i) {
      kd[i] = k.at(i);
      vd[i] = v.at(i);
    }
  }
  // max |out - the fp64 reference of @p cfg's pattern| over every output.
  // (@p out_at(i): output element i as a double.)
  const auto error_of = [&](const auto& out_at, const attention_config& cfg) {
    std::vector<double> ref(static_cast<std::size_t>(B * Lq * H * d));
    forward_args ra;
    ra.q = make_view(qd.data(), {B, Lq, H, d});
    ra.k = strided(kd.data());
    ra.v = strided(vd.data());
    ra.out = make_view(ref.data(), {B, Lq, H, d});
    attention_config rc = cfg;
    rc.backend = backend::reference;
    attention_forward(ra, rc);
    double err = 0;
    for (std::size_t i = 0; i < ref.size(); ++i) {
      const double e = std::fabs(out_at(i) - ref[i]);
      err = (std::isnan(e) || e > err) ? e : err;
    }
    return err;
  };
  for (auto& s : runs) {
    decode_row& r = s->r;
    r.iters = static_cast<int>(s->ms.size());
    if (r.ok) {
      r.ms = summarize(s->ms);
      r.gbs = kv_bytes / (r.ms.median * 1e6);
      if (check) r.max_err = error_of([&s](std::size_t i) { return s->out.at(i); }, s->cfg);
    }
    rows.push_back(r);
  }
  if (!with_sdpa && sdpa != nullptr && sdpa->started()) {  // it ended in an earlier configuration
    sdpa_row.c = c;
    sdpa_row.what = sdpa->name();
    sdpa_row.kernel = "-";
    sdpa_row.reason = "the SDPA co-process ended earlier (run it by hand: " + sdpa->command() + ")";
    rows.push_back(sdpa_row);
  }
  if (with_sdpa) {
    if (sdpa_row.ok) {
      sdpa_row.iters = static_cast<int>(sdpa_ms.size());
      sdpa_row.ms = summarize(sdpa_ms);
      sdpa_row.gbs = sdpa_kv_bytes / (sdpa_row.ms.median * 1e6);
      if (check) {
        // On the shared memory SDPA leaves its output ([B, Lq, H, d] fp32) there, and its error is
        // against the dense fp64 reference of the dfss rows; otherwise its own float64 check.
        const json e = sdpa->ask({{"cmd", "check"}});
        if (shared->ok() && e.value("wrote_out", false)) {
          attention_config dense;  // dense attention with the dfss rows' causal flag
          dense.pattern = pattern::parse("dense", "--patterns");
          dense.causal = true;
          const auto* o = reinterpret_cast<const float*>(shared->data() + o_at);
          sdpa_row.max_err = error_of([o](std::size_t i) { return static_cast<double>(o[i]); }, dense);
        } else if (e.contains("max_err") && e["max_err"].is_number()) {
          sdpa_row.max_err = get_num(e, "max_err");
        }
      }
    }
    sdpa->ask({{"cmd", "free"}});
    rows.push_back(sdpa_row);
  }
}

bool same_config(const decode_config& a, const decode_config& b) {
  return a.lk == b.lk && a.heads == b.heads && a.heads_kv == b.heads_kv && a.dtype == b.dtype;
}

std::string fmt(double x, int digits) {
  if (std::isnan(x)) return "-";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

std::string fmt_err(double x) {
  if (std::isnan(x)) return "-";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1e", x);
  return buf;
}

/// The ratios within each configuration of one round's @p rows: against its memory sweep (the
/// other buffer's sweep too, which shows how far another part of memory reads apart), SDPA and dfss
/// dense.
void set_ratios(std::vector<decode_row>& rows) {
  for (decode_row& r : rows) {
    if (!r.ok) continue;
    if (r.what == kSweepRow) continue;  // the yardstick itself: no ratios
    for (const decode_row& o : rows) {
      if (!o.ok || !same_config(o.c, r.c)) continue;
      if (o.what == kSweepRow) r.of_bandwidth = r.gbs / o.gbs;
      if (is_sweep_row(r.what)) continue;  // a yardstick too: no ratios but to the cache's sweep
      if (o.what.rfind("torch", 0) == 0) r.vs_sdpa = o.ms.median / r.ms.median;
      if (o.what == "dfss dense") r.vs_dense = o.ms.median / r.ms.median;
    }
  }
}

/// One row per configuration and row from the rounds (the first round's order and errors), as
/// `dfss bench --rounds` merges the forward's: each time the median of the rounds' medians (GB/s
/// from it), min and max over all rounds, each ratio the median of the per-round ratios. A row
/// that failed in some round is reported as failed. @p notes gets a line per dfss row with its
/// per-round % of bw, vs dense and vs SDPA.
std::vector<decode_row> merge_decode_rounds(const std::vector<std::vector<decode_row>>& rounds,
                                            std::vector<std::string>& notes) {
  std::vector<decode_row> out = rounds.at(0);
  if (rounds.size() == 1) return out;
  notes.push_back("per round (rounds 1.." + std::to_string(rounds.size()) + "), % of bw / vs dense / vs SDPA:");
  for (decode_row& r : out) {
    std::vector<const decode_row*> all;
    for (const auto& round : rounds) {
      for (const decode_row& x : round) {
        if (same_config(x.c, r.c) && x.what == r.what) all.push_back(&x);
      }
    }
    const bool every = all.size() == rounds.size() &&
                       std::all_of(all.begin(), all.end(), [](const decode_row* x) { return x->ok; });
    if (!every) {
      if (r.ok) {
        r.ok = false;
        r.reason = "failed in some round";
      }
      continue;
    }
    r.iters = 0;
    for (const decode_row* x : all) {
      r.round_ms.push_back(x->ms.median);
      r.round_of_bandwidth.push_back(x->of_bandwidth);
      r.round_vs_sdpa.push_back(x->vs_sdpa);
      r.round_vs_dense.push_back(x->vs_dense);
      r.ms.min = std::min(r.ms.min, x->ms.min);
      r.ms.max = std::max(r.ms.max, x->ms.max);
      r.iters += x->iters;
    }
    const double old_median = r.ms.median;
    r.ms.median = median_of(r.round_ms);
    r.gbs *= old_median / r.ms.median;
    r.of_bandwidth = median_of(r.round_of_bandwidth);
    r.vs_sdpa = median_of(r.round_vs_sdpa);
    r.vs_dense = median_of(r.round_vs_dense);
    if (r.what.rfind("dfss", 0) == 0) {
      std::string line = "  Lk=" + std::to_string(r.c.lk) + " " + std::to_string(r.c.heads) + ":" +
                         std::to_string(r.c.heads_kv) + " " + r.c.dtype + " " + r.what + ":";
      for (std::size_t k = 0; k < all.size(); ++k) {
        char buf[96];
        std::snprintf(buf, sizeof buf, "%s %.0f%% / %.2fx / %.2fx", k == 0 ? "" : ",", 100.0 * r.round_of_bandwidth[k],
                      r.round_vs_dense[k], r.round_vs_sdpa[k]);
        line += buf;
      }
      notes.push_back(line);
    }
  }
  return out;
}

}  // namespace

int run_decode() {
  if (g_opt.query_rows < 1) {
    std::fprintf(stderr, "dfss bench: argument '--query-rows': expected >= 1, got %lld\n", g_opt.query_rows);
    return kExitBadInput;
  }
  std::vector<decode_config> configs;
  for (long long lk : g_opt.lengths)
    for (const auto& hs : g_opt.decode_heads) {
      const auto [h, hkv] = parse_heads(hs);
      for (const auto& t : g_opt.decode_dtypes) {
        parse_dtype(t);
        configs.push_back({lk, h, hkv, t});
      }
    }
  const build_info info = get_build_info();
  const std::string date = now_utc(), commit = git_commit();
  std::printf("dfss bench --decode: dfss %s, %s; %s%s\n", info.version.c_str(), date.c_str(),
              commit.empty() ? "commit unknown" : "commit ", commit.c_str());
  std::printf("machine: %s, %d hardware threads; compiler: %s\n", cpu_model().c_str(), hardware_threads(),
              info.compiler.c_str());
  std::printf(
      "run: one decode step, B=%lld, Lq=%lld, d=%lld, causal (bottom-right), cache %s random normal, "
      "output in %s, %d threads, median of %d calls (round-robin with the memory sweep and SDPA, each after a "
      "128 MiB read elsewhere)\n",
      g_opt.batch, g_opt.query_rows, g_opt.head_dim,
      g_opt.cache_layout == "blhd" ? "[B, Lk, Hkv, d]" : "[B, Hkv, Lk, d]",
      g_opt.out_dtype == "f32" ? "f32" : "the cache's type", g_opt.threads, g_opt.iters);
  if (g_opt.rounds > 1) {
    std::printf(
        "rounds: %d (the whole sweep repeated: a row's times are the median of its rounds' medians, the min and max "
        "over all rounds; %% of bw, vs SDPA and vs dense the median of the per-round ratios; errors of round 1)\n",
        g_opt.rounds);
  }
  std::printf("load average at start: %s\n", load_average().c_str());
  std::printf("repro: dfss bench --decode --lengths %s --decode-heads %s --decode-dtypes %s --patterns %s "
              "--query-rows %lld --batch %lld --head-dim %lld --cache-layout %s --threads %d --iters %d --rounds %d "
              "--seed %llu --isa %s%s%s\n\n",
              join(g_opt.lengths).c_str(), join(g_opt.decode_heads).c_str(), join(g_opt.decode_dtypes).c_str(),
              join(g_opt.patterns).c_str(), g_opt.query_rows, g_opt.batch, g_opt.head_dim, g_opt.cache_layout.c_str(),
              g_opt.threads,
              g_opt.iters, g_opt.rounds, g_opt.seed, g_opt.isas.at(0).c_str(), g_opt.no_torch ? " --no-torch" : "",
              g_opt.out_dtype == "f32" ? " --out-dtype f32" : "");
  std::fflush(stdout);
  std::vector<std::string> notes;
  std::unique_ptr<sdpa_peer> sdpa;
  if (!g_opt.no_torch) sdpa = std::make_unique<sdpa_peer>(notes);
  const int sdpa_rows = sdpa != nullptr && sdpa->alive() ? 1 : 0;
  g_progress.enable(g_opt.progress || isatty(STDERR_FILENO) != 0, isatty(STDERR_FILENO) != 0);
  g_progress.add_rows(g_opt.rounds * static_cast<int>(configs.size() * (g_opt.patterns.size() + 1 + sdpa_rows)));

  // --rounds R: the whole sweep (every configuration) R times; the host moves a single sweep's
  // ratios by more than the kernels' margins over the bars.
  std::vector<std::vector<decode_row>> rounds(static_cast<std::size_t>(g_opt.rounds));
  for (std::size_t k = 0; k < rounds.size(); ++k) {
    for (const auto& c : configs) bench_decode_config(c, rounds[k], sdpa.get());
    set_ratios(rounds[k]);
  }
  sdpa.reset();  // the co-process ends with its input
  g_progress.done();
  std::vector<decode_row> rows = merge_decode_rounds(rounds, notes);
  std::stable_sort(rows.begin(), rows.end(), [&](const decode_row& x, const decode_row& y) {
    const auto index = [&](const decode_config& c) {
      for (std::size_t i = 0; i < configs.size(); ++i)
        if (same_config(configs[i], c)) return i;
      return configs.size();
    };
    return index(x.c) < index(y.c);
  });
  std::printf("%-6s %-7s %-5s %-24s %-30s %5s %10s %9s %9s %8s %8s %8s %9s %9s\n", "Lk", "H:Hkv", "cache", "row",
              "kernel", "iters", "ms median", "ms min", "ms max", "GB/s", "% of bw", "vs SDPA", "vs dense",
              "max err");
  const decode_config* last = nullptr;
  for (const decode_row& r : rows) {
    if (last != nullptr && !same_config(*last, r.c)) std::printf("\n");
    last = &r.c;
    const std::string hh = std::to_string(r.c.heads) + ":" + std::to_string(r.c.heads_kv);
    if (!r.ok) {
      std::printf("%-6lld %-7s %-5s %-24s %-30s not run: %s\n", r.c.lk, hh.c_str(), r.c.dtype.c_str(), r.what.c_str(),
                  r.kernel.c_str(), r.reason.c_str());
      continue;
    }
    std::printf("%-6lld %-7s %-5s %-24s %-30s %5d %10s %9s %9s %8s %8s %8s %9s %9s\n", r.c.lk, hh.c_str(),
                r.c.dtype.c_str(), r.what.c_str(), r.kernel.c_str(), r.iters, fmt(r.ms.median, 3).c_str(),
                fmt(r.ms.min, 3).c_str(), fmt(r.ms.max, 3).c_str(), fmt(r.gbs, 1).c_str(),
                fmt(100.0 * r.of_bandwidth, 0).c_str(), fmt(r.vs_sdpa, 2).c_str(), fmt(r.vs_dense, 2).c_str(),
                fmt_err(r.max_err).c_str());
  }
  std::printf("\n");
  for (const auto& n : notes) std::printf("%s\n", n.c_str());
  std::printf("load average at end: %s\n", load_average().c_str());
  if (!g_opt.json.empty()) {
    json j;
    j["mode"] = "decode";
    j["date"] = date;
    j["commit"] = commit;
    j["cpu"] = cpu_model();
    j["threads"] = g_opt.threads;
    j["batch"] = g_opt.batch;
    j["query_rows"] = g_opt.query_rows;
    j["head_dim"] = g_opt.head_dim;
    j["rounds"] = g_opt.rounds;
    j["out_dtype"] = g_opt.out_dtype;  // "input": O in the cache's type
    j["notes"] = notes;
    j["rows"] = json::array();
    for (const decode_row& r : rows) {
      j["rows"].push_back({{"Lk", r.c.lk}, {"H", r.c.heads}, {"Hkv", r.c.heads_kv}, {"cache", r.c.dtype},
                           {"row", r.what}, {"kernel", r.kernel}, {"ok", r.ok}, {"reason", r.reason},
                           {"iters", r.iters}, {"ms_median", r.ms.median}, {"ms_min", r.ms.min},
                           {"ms_max", r.ms.max}, {"gbs", r.gbs}, {"fraction_of_bandwidth", r.of_bandwidth},
                           {"vs_sdpa", r.vs_sdpa}, {"vs_dense", r.vs_dense}, {"max_err", r.max_err}});
      if (!r.round_ms.empty()) {
        j["rows"].back()["rounds_ms_median"] = r.round_ms;
        j["rows"].back()["rounds_fraction_of_bandwidth"] = r.round_of_bandwidth;
        j["rows"].back()["rounds_vs_sdpa"] = r.round_vs_sdpa;
        j["rows"].back()["rounds_vs_dense"] = r.round_vs_dense;
      }
    }
    const std::string text = j.dump(2) + "\n";  // non-finite numbers are written as null
    try {
      files::replace(g_opt.json, {files::piece(reinterpret_cast<const unsigned char*>(text.data()), text.size())});
    } catch (const files::write_error& e) {
      std::fprintf(stderr, "dfss bench: --json %s: %s\n", g_opt.json.c_str(), e.what());
      return kExitInternal;
    }
    std::printf("wrote %s\n", g_opt.json.c_str());
  }
  std::printf(
      "\nGB/s = dense K + V bytes of the cache / median time (the sparse rows read all of K but only the kept\n"
      "rows of V, so theirs is a dense-equivalent rate); %% of bw = against the memory sweep of the same\n"
      "configuration (a read-only pass over the cache's own K and V with the same threads, timed round-robin\n"
      "with the dfss rows and SDPA, each call after a read of 128 MiB elsewhere that empties the CPU's caches;\n"
      "'memory sweep, other' is the same pass over a buffer of that size allocated after\n"
      "the cache, its %% of bw the rate of that other memory against the cache's; 'memory sweep, K + half V'\n"
      "reads all of K and one random row of every two of V, the least a 1:2 step reads: its %% of bw is the\n"
      "most that skipping V rows can gain over the cache's sweep on this machine); vs SDPA = SDPA median /\n"
      "row median (> 1: faster than SDPA); vs dense = dfss dense median / row median; max err = max |out -\n"
      "fp64 reference| over every output, for caches up to %lld keys (torch: vs float64 of the same math,\n"
      "every length).\n",
      kDecodeRefKeys);
  return kExitOk;
}

}  // namespace dfss::cli::bench
