// The dfss rows of `dfss bench`: every (pattern, algorithm, ISA) of one length, timed round-robin,
// with the error against the fp64 reference (forward: the first --ref-rows query rows; --backward:
// dQ, dK, dV on a reduced problem).
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>

#include "cli/bench/bench.hpp"

namespace dfss::cli::bench {

struct run_state {
  row r;
  attention_config cfg;
  input_tensor out;                    // O, in output_dtype
  std::vector<float> lse, dq, dk, dv;  // --backward
  std::vector<double> ms;
  int target = 0;
};

/// --backward: the backward arguments of one configuration (its outputs, the forward's O and LSE).
backward_args make_backward_args(const forward_args& a, run_state& s, const tensor_view& dout,
                                 std::int64_t B, std::int64_t L, std::int64_t H, std::int64_t d) {
  backward_args b;
  b.q = a.q;
  b.k = a.k;
  b.v = a.v;
  b.out = s.out.view(B, L, H, d);
  b.lse = make_view(s.lse.data(), {B, H, L});
  b.dout = dout;
  b.dq = make_view(s.dq.data(), {B, L, H, d});
  b.dk = make_view(s.dk.data(), {B, L, H, d});
  b.dv = make_view(s.dv.data(), {B, L, H, d});
  return b;
}

/// One timed unit of a configuration: the forward call, then with --backward the backward call.
status call_once(forward_args& a, run_state& s, const tensor_view& dout, std::int64_t B, std::int64_t L,
                 std::int64_t H, std::int64_t d) {
  a.out = s.out.view(B, L, H, d);
  if (!g_opt.backward) return try_attention_forward(a, s.cfg);
  a.lse = make_view(s.lse.data(), {B, H, L});
  const status st = try_attention_forward(a, s.cfg);
  if (!st.ok()) return st;
  return try_attention_backward(make_backward_args(a, s, dout, B, L, H, d), s.cfg);
}

/// --backward: max |dQ, dK, dV - fp64 reference| over every element, on the problem of length
/// Le = min(L, kBackwardRefLength) with the same B, H, d, dtype, seed convention and configuration
/// (at L = Le these are the timed row's own inputs). Cached per (pattern, ISA, Le).
double backward_max_error(const attention_config& cfg, long long L, dtype type) {
  static std::map<std::string, double> cache;
  const std::int64_t B = g_opt.batch, H = g_opt.heads, d = g_opt.head_dim;
  const std::int64_t Le = std::min(L, kBackwardRefLength);
  const std::string key = cfg.pattern.str() + "|" + std::to_string(static_cast<int>(cfg.cpu_isa)) + "|" +
                          std::to_string(Le);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  log_stderr("  L=%lld %s: gradient error vs fp64 reference backward at L=%lld\n", L,
               cfg.pattern.str().c_str(), static_cast<long long>(Le));
  const auto n = static_cast<std::size_t>(B * Le * H * d);
  std::mt19937_64 rng(g_opt.seed + static_cast<unsigned long long>(Le));
  input_tensor q, k, v, dout;
  q.fill(n, type, rng);
  k.fill(n, type, rng);
  v.fill(n, type, rng);
  dout.fill(n, type, rng);
  run_state s;
  s.cfg = cfg;
  s.out.assign(n, output_dtype(type), 0.0f);
  s.lse.assign(static_cast<std::size_t>(B * H * Le), 0.0f);
  s.dq.assign(n, 0.0f);
  s.dk.assign(n, 0.0f);
  s.dv.assign(n, 0.0f);
  forward_args a;
  a.q = q.view(B, Le, H, d);
  a.k = k.view(B, Le, H, d);
  a.v = v.view(B, Le, H, d);
  const status st = call_once(a, s, dout.view(B, Le, H, d), B, Le, H, d);
  if (!st.ok()) return kNaN;

  std::vector<double> qd(n), kd(n), vd(n), dod(n), dqd(n, 0.0), dkd(n, 0.0), dvd(n, 0.0);
  for (std::size_t i = 0; i < n; ++i) {
    qd[i] = q.at(i);
    kd[i] = k.at(i);
    vd[i] = v.at(i);
    dod[i] = dout.at(i);
  }
  backward_args rb;  // O and LSE are recomputed by the reference
  rb.q = make_view(qd.data(), {B, Le, H, d});
  rb.k = make_view(kd.data(), {B, Le, H, d});
  rb.v = make_view(vd.data(), {B, Le, H, d});
  rb.dout = make_view(dod.data(), {B, Le, H, d});
  rb.dq = make_view(dqd.data(), {B, Le, H, d});
  rb.dk = make_view(dkd.data(), {B, Le, H, d});
  rb.dv = make_view(dvd.data(), {B, Le, H, d});
  attention_config rc = cfg;
  rc.backend = backend::reference;
  attention_backward(rb, rc);
  double err = 0;
  auto compare = [&err](const std::vector<float>& got, const std::vector<double>& want) {
    for (std::size_t i = 0; i < got.size(); ++i) {
      const double e = std::fabs(static_cast<double>(got[i]) - want[i]);
      err = (std::isnan(e) || e > err) ? e : err;
    }
  };
  compare(s.dq, dqd);
  compare(s.dk, dkd);
  compare(s.dv, dvd);
  cache.emplace(key, err);
  return err;
}

/// Whether (algorithm, pattern, index of the ISA in --isa) is a row of the table. Three-stage rows are
/// made for the sparse patterns (the three-stage pipeline of dense attention is not the paper's),
/// once, not per ISA (the selector has one three-stage kernel), and not with --backward (no backward).
bool makes_row(cpu_algorithm algorithm, const pattern& p, std::size_t isa_index) {
  return algorithm != cpu_algorithm::three_stage || !(p.is_dense() || isa_index > 0 || g_opt.backward);
}

/// dfss rows per length (for the progress line).
int dfss_rows_per_length() {
  int n = 0;
  for (std::size_t ii = 0; ii < g_opt.isas.size(); ++ii)
    for (const auto& pat : g_opt.patterns)
      for (const auto& alg : g_opt.algorithms)
        n += makes_row(parse_cpu_algorithm_arg(alg), pattern::parse(pat, "--patterns"), ii) ? 1 : 0;
  return n;
}

void bench_length(long long L, dtype type, std::vector<row>& rows, sgemm_result& sg, torch_server* torch) {
  const std::int64_t B = g_opt.batch, H = g_opt.heads, d = g_opt.head_dim;
  const auto n = static_cast<std::size_t>(B * L * H * d);
  std::mt19937_64 rng(g_opt.seed + static_cast<unsigned long long>(L));
  input_tensor q, k, v;
  q.fill(n, type, rng);
  k.fill(n, type, rng);
  v.fill(n, type, rng);
  input_tensor dout;  // --backward: dO, standard normal
  tensor_view dout_view;
  if (g_opt.backward) {
    dout.fill(n, type, rng);
    dout_view = dout.view(B, L, H, d);
  }
  forward_args a;
  a.q = q.view(B, L, H, d);
  a.k = k.view(B, L, H, d);
  a.v = v.view(B, L, H, d);

  // The configurations of this shape (makes_row).
  std::vector<std::unique_ptr<run_state>> runs;
  for (std::size_t ii = 0; ii < g_opt.isas.size(); ++ii) {
    for (const auto& pat : g_opt.patterns) {
      for (const auto& alg : g_opt.algorithms) {
        const cpu_algorithm algorithm = parse_cpu_algorithm_arg(alg);
        const pattern p = pattern::parse(pat, "--patterns");
        if (!makes_row(algorithm, p, ii)) continue;
        auto s = std::make_unique<run_state>();
        s->cfg.pattern = p;
        s->cfg.backend = backend::cpu;
        s->cfg.num_threads = g_opt.threads;
        s->cfg.cpu_algorithm = algorithm;
        s->cfg.cpu_isa = parse_cpu_isa(g_opt.isas[ii], "--isa");
        s->cfg.causal = g_opt.causal;
        s->r.source = "dfss";
        s->r.B = B;
        s->r.H = H;
        s->r.L = L;
        s->r.d = d;
        s->r.dtype = dtype_label(g_opt.dtype_name);
        s->r.pattern = p.str();
        s->r.algorithm = algorithm == cpu_algorithm::fused ? "fused" : "three-stage";
        s->r.isa = algorithm == cpu_algorithm::fused ? g_opt.isas[ii] : "-";
        runs.push_back(std::move(s));
      }
    }
  }

  // Selection, first call (which also sizes the iteration count) and warmup.
  const int first_row = g_rows_done + 1;
  for (std::size_t ri = 0; ri < runs.size(); ++ri) {
    auto& s = runs[ri];
    g_progress.show(first_row + static_cast<int>(ri), 1,
                    "L=" + std::to_string(L) + " " + s->r.pattern + " " + s->r.algorithm + ": first call and warmup");
    s->out.assign(n, output_dtype(type), 0.0f);
    a.out = s->out.view(B, L, H, d);
    kernel_selection sel = select_kernel(a, s->cfg);
    if (g_opt.backward) {
      // The kernel column names both calls: "forward kernel+backward kernel".
      s->lse.assign(static_cast<std::size_t>(B * H * L), 0.0f);
      s->dq.assign(n, 0.0f);
      s->dk.assign(n, 0.0f);
      s->dv.assign(n, 0.0f);
      a.lse = make_view(s->lse.data(), {B, H, L});
      if (sel.supported()) {
        const kernel_selection bsel = select_kernel(make_backward_args(a, *s, dout_view, B, L, H, d), s->cfg);
        if (bsel.supported()) {
          sel.name += "+" + bsel.name;
        } else {
          sel.kind = kernel_kind::none;
          sel.reason = "backward: " + bsel.reason;
        }
      }
    }
    s->r.kernel = sel.supported() ? sel.name : "-";
    if (!sel.supported()) {
      s->r.reason = sel.reason;
      continue;
    }
    log_stderr("  L=%lld %s %s (%s): warmup\n", L, s->r.pattern.c_str(), s->r.algorithm.c_str(),
               s->r.kernel.c_str());
    const auto t0 = std::chrono::steady_clock::now();
    const status st = call_once(a, *s, dout_view, B, L, H, d);
    const double first = elapsed_ms(t0);
    if (!st.ok()) {
      s->r.reason = st.message;
      continue;
    }
    const int warmup = first > 1000.0 ? 1 : g_opt.warmup;
    for (int i = 1; i < warmup; ++i) call_once(a, *s, dout_view, B, L, H, d);
    s->target = timed_iterations(first);
    s->r.ok = true;
  }
  // The torch entries of this length in the co-process (its own inputs, drawn alike): first call,
  // warm-up and the iteration count as the dfss rows'.
  struct served {
    row r;
    std::string id;
    int target = 0;
    std::vector<double> ms;
  };
  std::vector<served> peers;
  if (torch != nullptr && torch->alive()) {
    const std::string version = get_str(torch->hello(), "torch_version");
    for (const auto& [dtype_name, method] : torch_entries()) {
      served e;
      e.r.source = "torch";
      e.r.B = B;
      e.r.H = H;
      e.r.L = L;
      e.r.d = d;
      e.r.pattern = "dense";
      e.r.isa = "-";
      e.r.dtype = dtype_name;
      e.r.kernel = "python " + get_str(torch->hello(), "python_version") + " " + dtype_name;
      log_stderr("  L=%lld torch %s %s %s: first call and warmup\n", L, version.c_str(), method.c_str(),
                 dtype_name.c_str());
      const json ready = torch->ask({{"cmd", "setup"}, {"L", L}, {"dtype", dtype_name}, {"method", method}});
      e.r.algorithm = "torch " + version + " " + (ready.contains("method") ? get_str(ready, "method") : method);
      if (ready.contains("error")) {
        e.r.reason = get_str(ready, "error");
      } else {
        e.r.ok = true;
        e.id = get_str(ready, "id");
        e.target = timed_iterations(get_num(ready, "first_ms"));
      }
      peers.push_back(std::move(e));
    }
    hand_off();
  }

  // Timed calls, round-robin over the configurations (one sgemm yardstick call and one call of each
  // torch entry per round).
  for (int it = 0;; ++it) {
    if (it < g_opt.iters)
      g_progress.show(first_row, static_cast<int>(runs.size() + peers.size()),
                      "L=" + std::to_string(L) + ": timed round " + std::to_string(it + 1) + " of up to " +
                          std::to_string(g_opt.iters));
    if (it < g_opt.iters) sg.time_one();
    bool any = false;
    for (auto& s : runs) {
      if (!s->r.ok || it >= s->target) continue;
      any = true;
      const auto t0 = std::chrono::steady_clock::now();
      const status st = call_once(a, *s, dout_view, B, L, H, d);
      const double t = elapsed_ms(t0);
      if (!st.ok()) {
        s->r.ok = false;
        s->r.reason = st.message;
        continue;
      }
      s->ms.push_back(t);
    }
    bool asked = false;
    for (auto& e : peers) {
      if (!e.r.ok || it >= e.target) continue;
      any = asked = true;
      const json t = torch->ask({{"cmd", "time"}, {"id", e.id}});
      if (t.contains("error")) {
        e.r.ok = false;
        e.r.reason = get_str(t, "error");
      } else {
        e.ms.push_back(get_num(t, "ms"));
      }
    }
    if (asked) hand_off();
    if (!any) break;
  }
  for (auto& e : peers) {
    e.r.iters = static_cast<int>(e.ms.size());
    if (e.r.ok) {
      e.r.ms = summarize(e.ms);
      e.r.gflops = attention_flops(B, H, L, d) / (e.r.ms.median * 1e6);
      if (!g_opt.no_ref) {
        const json err = torch->ask({{"cmd", "check"}, {"id", e.id}});
        if (err.contains("max_err") && err["max_err"].is_number()) e.r.max_err = get_num(err, "max_err");
      }
    }
  }
  if (!peers.empty()) torch->ask({{"cmd", "free"}});

  g_rows_done += static_cast<int>(runs.size() + peers.size());
  // --backward: the gradient error on the reduced problem (see backward_max_error).
  if (g_opt.backward) {
    for (auto& s : runs) {
      row& r = s->r;
      r.iters = static_cast<int>(s->ms.size());
      if (!r.ok) continue;
      r.ms = summarize(s->ms);
      r.gflops = attention_flops(B, H, L, d) / (r.ms.median * 1e6);
      if (!g_opt.no_ref && g_opt.ref_rows > 0) r.max_err = backward_max_error(s->cfg, L, type);
    }
    for (auto& s : runs) rows.push_back(std::move(s->r));
    return;
  }

  // fp64 reference on R query rows of every head (one per pattern): the first R, or with --causal the
  // last R, which see the keys they see in the full problem under the bottom-right causal mask.
  const std::int64_t R = std::min<std::int64_t>(g_opt.ref_rows, L);
  const std::int64_t r0 = g_opt.causal ? L - R : 0;
  std::map<std::string, std::vector<double>> refs;
  std::vector<double> qd, kd, vd;
  if (!g_opt.no_ref && R > 0) {
    qd.resize(static_cast<std::size_t>(B * R * H * d));
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < R * H * d; ++i)
        qd[static_cast<std::size_t>(b * R * H * d + i)] = q.at(static_cast<std::size_t>((b * L + r0) * H * d + i));
    kd.resize(n);
    vd.resize(n);
    for (std::size_t i = 0; i < n; ++i) {
      kd[i] = k.at(i);
      vd[i] = v.at(i);
    }
  }
  for (auto& s : runs) {
    row& r = s->r;
    r.iters = static_cast<int>(s->ms.size());
    if (!r.ok) continue;
    r.ms = summarize(s->ms);
    r.gflops = attention_flops(B, H, L, d) / (r.ms.median * 1e6);
    if (g_opt.no_ref || R == 0) continue;
    auto [it, inserted] = refs.try_emplace(r.pattern);
    if (inserted) {
      log_stderr("  L=%lld %s: fp64 reference on %lld query rows per head\n", L, r.pattern.c_str(),
                 static_cast<long long>(R));
      it->second.assign(static_cast<std::size_t>(B * R * H * d), 0.0);
      forward_args ra;
      ra.q = make_view(qd.data(), {B, R, H, d});
      ra.k = make_view(kd.data(), {B, L, H, d});
      ra.v = make_view(vd.data(), {B, L, H, d});
      ra.out = make_view(it->second.data(), {B, R, H, d});
      attention_config rc = s->cfg;
      rc.backend = backend::reference;
      attention_forward(ra, rc);
    }
    double err = 0;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < R * H * d; ++i) {
        const double got = s->out.at(static_cast<std::size_t>((b * L + r0) * H * d + i));
        const double want = it->second[static_cast<std::size_t>(b * R * H * d + i)];
        const double e = std::fabs(got - want);
        err = (std::isnan(e) || e > err) ? e : err;
      }
    r.max_err = err;
  }
  for (auto& s : runs) rows.push_back(std::move(s->r));
  for (auto& e : peers) rows.push_back(std::move(e.r));
}

/// The selector's kernel for dense fused attention of the sweep's first shape and --isa (the header's
/// "kernel:" line): the name ends with the ISA that runs, e.g. cpu.fused_forward.avx2.
std::string dense_kernel_name(dtype type) {
  const std::int64_t B = 1, L = 16, H = 1, d = g_opt.head_dim;  // the selector looks at types and d, not L
  const auto n = static_cast<std::size_t>(B * L * H * d);
  std::mt19937_64 rng(g_opt.seed);
  input_tensor q, out;
  q.fill(n, type, rng);
  out.assign(n, output_dtype(type), 0.0f);
  forward_args a;
  a.q = a.k = a.v = q.view(B, L, H, d);
  a.out = out.view(B, L, H, d);
  attention_config cfg;
  cfg.backend = backend::cpu;
  cfg.pattern = pattern::parse("dense", "--patterns");
  cfg.cpu_algorithm = cpu_algorithm::fused;
  cfg.cpu_isa = parse_cpu_isa_arg(g_opt.isas.at(0));
  const kernel_selection sel = select_kernel(a, cfg);
  return sel.supported() ? sel.name : "unsupported (" + sel.reason + ")";
}

}  // namespace dfss::cli::bench
