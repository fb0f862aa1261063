// `dfss quality`: how well DFSS approximates full attention on given Q, K, V, next to other efficient
// attentions at the same budget.
//
// The exact function is full softmax attention computed in fp64 (tools/quality). The DFSS output
// comes from the library itself, dfss::attention_forward with the automatic backend (what users
// run: the CPU kernel for float32 and float16 inputs, the fp64 reference for float64), and its kept
// mass from the N:M selection of the exact scores (dfss/format/nm_select.hpp, the rule every backend
// runs). The baselines are fp64 functions of tools/quality/quality.hpp.
//
// Budget of a pattern N:M: every sparse method keeps in each row exactly as many keys as DFSS does
// there (N per group of M visible keys; with --causal the visible keys of the row). Performer and
// Nystromformer get as many random features / landmarks as a row that sees all keys keeps, so that
// their O(L m d) feature products match the sparse methods' O(L k d) work on kept keys (their
// additional terms, e.g. Nystromformer's O(m^3) pseudo-inverse, are not charged: generous to them).
#include <omp.h>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <exception>
#include <iostream>
#include <limits>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/commands.hpp"
#include "cli/output_paths.hpp"
#include "dfss/dfss.hpp"
#include "npy/files.hpp"
#include "npy/npy.hpp"
#include "cli/npy_view.hpp"
#include "quality/quality.hpp"

namespace dfss::cli {
namespace {

namespace ql = dfss::quality;

/// A user-facing input problem: reported as "dfss quality: <message>" with exit code 2.
struct bad_input : std::runtime_error {
  using std::runtime_error::runtime_error;
};

int fail(const std::string& message) {
  std::cerr << "dfss quality: " << message << "\n";
  return kExitBadInput;
}

std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

/// One element of an operand as a double (exact for every accepted type).
double element(const npy::array& a, std::size_t i) {
  switch (a.type) {
    case dtype::f64: return a.data<double>()[i];
    case dtype::f32: return static_cast<double>(a.data<float>()[i]);
    case dtype::f16: return static_cast<double>(f16_to_float(a.data<std::uint16_t>()[i]));
    default: throw bad_input(std::string("unexpected element type ") + dtype_name(a.type));
  }
}

/// Loads an operand: float64, float32 or float16, shaped [B, L, H, d], every value finite (the
/// metrics of non-finite inputs would be NaN everywhere and say nothing).
npy::array load_operand(const std::string& path, const char* flag) {
  npy::array a = npy::read(path);
  if (a.type != dtype::f64 && a.type != dtype::f32 && a.type != dtype::f16) {
    throw bad_input(std::string(flag) + " " + path + ": expected float64, float32 or float16 data, got " +
                    dtype_name(a.type));
  }
  if (a.shape.size() != 4) {
    throw bad_input(std::string(flag) + " " + path + ": expected shape [B, L, H, d] (4 dimensions), got " +
                    shape_str(a.shape));
  }
  const auto n = static_cast<std::size_t>(a.numel());
  for (std::size_t i = 0; i < n; ++i) {
    if (!std::isfinite(element(a, i))) {
      throw bad_input(std::string(flag) + " " + path + ": expected finite values, found " +
                      std::to_string(element(a, i)) + " at flat index " + std::to_string(i));
    }
  }
  return a;
}

/// Head (b, h) of a [B, L, H, d] operand as an [L, d] fp64 matrix.
ql::matrix head_slice(const npy::array& a, std::int64_t b, std::int64_t h) {
  const std::int64_t L = a.shape[1], H = a.shape[2], d = a.shape[3];
  ql::matrix m(L, d);
  for (std::int64_t i = 0; i < L; ++i) {
    const auto base = static_cast<std::size_t>(((b * L + i) * H + h) * d);
    for (std::int64_t c = 0; c < d; ++c) m(i, c) = element(a, base + static_cast<std::size_t>(c));
  }
  return m;
}

/// Head (b, h) of a [B, L, H, d] float32 or float64 output buffer as an fp64 matrix.
ql::matrix output_slice(const std::vector<double>& o, std::int64_t L, std::int64_t H, std::int64_t d, std::int64_t b,
                        std::int64_t h) {
  ql::matrix m(L, d);
  for (std::int64_t i = 0; i < L; ++i) {
    for (std::int64_t c = 0; c < d; ++c) m(i, c) = o[static_cast<std::size_t>(((b * L + i) * H + h) * d + c)];
  }
  return m;
}

/// The measurements of one (pattern, method) cell, accumulated over heads.
struct cell {
  ql::error_sums err;
  ql::error_sums function_err;  ///< dfss only: the fp64 DFSS function (not the kernel) vs exact
  ql::error_sums kernel_vs_function;  ///< dfss only: kernel output vs the fp64 DFSS function
  std::vector<double> cos, mass;
  void merge(const cell& o) {
    err.diff2 += o.err.diff2, err.ref2 += o.err.ref2;
    function_err.diff2 += o.function_err.diff2, function_err.ref2 += o.function_err.ref2;
    kernel_vs_function.diff2 += o.kernel_vs_function.diff2, kernel_vs_function.ref2 += o.kernel_vs_function.ref2;
    cos.insert(cos.end(), o.cos.begin(), o.cos.end());
    mass.insert(mass.end(), o.mass.begin(), o.mass.end());
  }
};

struct table_row {
  std::string pattern, method;
  bool sparse = true, supported = true;
  std::string reason;
  std::int64_t budget = 0;  ///< keys per row (largest row) or features / landmarks
  double rel_error = 0, cosine = 0, mass_mean = 0, mass_p5 = 0;
  double function_rel_error = 0, kernel_vs_function = 0;
};

std::string fixed(double x, int digits) {
  if (std::isnan(x)) return "n/a";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.*f", digits, x);
  return buf;
}

std::string sci(double x) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.3e", x);
  return buf;
}

/// JSON number, or null for NaN / infinity (strict JSON has neither).
nlohmann::json num(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

}  // namespace

void add_quality_command(CLI::App& app, quality_options& o) {
  CLI::App* c = app.add_subcommand(
      "quality",
      "Approximation quality of DFSS against full attention, next to other efficient attentions at the same "
      "budget");
  c->footer(
      "Methods: dfss (the library's kernel, automatic backend), topk (exact top-k per row), window (local "
      "window; causal: the most recent keys), random (uniform keys per row), bigbird (window 3/8 + global 1/4 + "
      "random blocks), performer (FAVOR+ positive orthogonal random features), nystrom (Nystromformer, "
      "segment-mean landmarks, 6-step iterative pseudo-inverse; no causal form, reported unsupported with "
      "--causal).\n"
      "Budget of a pattern N:M: every sparse method keeps in each row as many keys as DFSS does (N per group "
      "of M visible keys); performer and nystrom get m features / landmarks, m = the keys kept by a row that "
      "sees all Lk keys, so their O(L m d) products match O(L k d).\n"
      "Metrics against fp64 full softmax attention: rel_err = ||O - O_full||_F / ||O_full||_F over all "
      "heads, cosine = mean cosine similarity of output rows, mass = kept full-softmax probability per row "
      "(mean and 5th percentile; sparse methods only). Rows without visible keys are left out of cosine and "
      "mass. Not supported: key padding and bias (use inputs without padding).");
  c->add_option("--q", o.q, "queries [B, Lq, H, d] (float64, float32 or float16)")->required();
  c->add_option("--k", o.k, "keys [B, Lk, Hkv, d], same type as --q")->required();
  c->add_option("--v", o.v, "values [B, Lk, Hkv, d], same type as --q")->required();
  c->add_option("--patterns", o.patterns, "N:M patterns (the budgets), comma separated")
      ->delimiter(',')
      ->capture_default_str();
  c->add_option("--methods", o.methods, "methods, comma separated: dfss, topk, window, random, bigbird, performer, nystrom")
      ->delimiter(',')
      ->capture_default_str();
  c->add_flag("--causal", o.causal, "bottom-right aligned causal mask (budgets count visible keys)");
  c->add_option("--scale", o.scale, "softmax scale (default 1/sqrt(d))");
  c->add_option("--seed", o.seed, "seed of the random, bigbird and performer methods")->capture_default_str();
  c->add_option("--threads", o.threads, "worker threads (0: all)");
  c->add_option("--json", o.json, "also write the table as JSON to FILE");
}

int run_quality(const quality_options& o) {
  try {
    if (o.patterns.empty()) return fail("--patterns: expected at least one N:M pattern");
    if (o.methods.empty()) return fail("--methods: expected at least one method");
    std::vector<pattern> patterns;
    for (const auto& p : o.patterns) patterns.push_back(pattern::parse(p, "--patterns"));
    std::vector<ql::method> methods;
    for (const auto& m : o.methods) methods.push_back(ql::parse_method(m, "--methods"));
    if (o.threads < 0 || o.threads > kMaxThreads) {
      return fail("--threads: expected a count in [0, " + std::to_string(kMaxThreads) + "], got " +
                  std::to_string(o.threads));
    }
    // Checked before the work, so that an unwritable path is reported at once; the file is replaced
    // (atomically) only when the table is complete.
    if (!o.json.empty()) {
      const std::string problem =
          output_path_problem({{"--q", o.q}, {"--k", o.k}, {"--v", o.v}}, {{"--json", o.json}});
      if (!problem.empty()) return fail(problem);
    }

    npy::array q = load_operand(o.q, "--q");
    npy::array k = load_operand(o.k, "--k");
    npy::array v = load_operand(o.v, "--v");
    if (k.type != q.type || v.type != q.type) {
      return fail(std::string("--k and --v must have the type of --q (") + dtype_name(q.type) + "), got " +
                  dtype_name(k.type) + " and " + dtype_name(v.type));
    }
    const std::int64_t B = q.shape[0], Lq = q.shape[1], H = q.shape[2], d = q.shape[3];
    const std::int64_t Lk = k.shape[1], Hkv = k.shape[2];
    // Empty operands have no attention to approximate (and no budget to match).
    for (const auto& [flag, arr] : {std::pair{"--q", &q}, std::pair{"--k", &k}}) {
      for (std::size_t dim = 0; dim < 4; ++dim) {
        if (arr->shape[dim] == 0) {
          return fail(std::string(flag) + ": expected no empty dimension, got shape " + shape_str(arr->shape));
        }
      }
    }

    attention_config cfg;
    cfg.scale = o.scale;
    cfg.causal = o.causal;
    cfg.num_threads = o.threads;
    const dtype out_type = q.type == dtype::f64 ? dtype::f64 : dtype::f32;
    std::vector<double> out_f64;
    std::vector<float> out_f32;
    forward_args fa;
    fa.q = view_of(q);
    fa.k = view_of(k);
    fa.v = view_of(v);
    const auto numel = static_cast<std::size_t>(B * Lq * H * d);
    if (out_type == dtype::f64) {
      out_f64.assign(numel, 0.0);
      fa.out = make_view(out_f64.data(), {B, Lq, H, d});
    } else {
      out_f32.assign(numel, 0.0f);
      fa.out = make_view(out_f32.data(), {B, Lq, H, d});
    }
    // Validates every argument (shapes, grouped heads, scale) with the library's own messages
    // before any work, and names the kernel that produces the DFSS rows.
    const kernel_selection sel = select_kernel(fa, cfg);
    if (!sel.supported()) return fail("the library cannot run these inputs: " + sel.reason);
    const double scale = o.scale > 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(d));

    // The DFSS outputs of every pattern from the library's kernel.
    std::vector<std::vector<double>> kernel_out(patterns.size());
    for (std::size_t pi = 0; pi < patterns.size(); ++pi) {
      if (std::find(methods.begin(), methods.end(), ql::method::dfss) == methods.end()) break;
      cfg.pattern = patterns[pi];
      attention_forward(fa, cfg);
      kernel_out[pi] = out_type == dtype::f64 ? out_f64 : std::vector<double>(out_f32.begin(), out_f32.end());
    }

    const std::size_t n_cells = patterns.size() * methods.size();
    auto unsupported = [&](ql::method m) { return m == ql::method::nystrom && o.causal; };
    std::vector<std::vector<cell>> per_head(static_cast<std::size_t>(B * H), std::vector<cell>(n_cells));
    const int threads = o.threads > 0 ? o.threads : omp_get_max_threads();
    std::vector<std::exception_ptr> failures(static_cast<std::size_t>(B * H));
    // One task per head; each head writes only its own cells and the cells are merged in head order
    // below, so the table does not depend on the thread count.
#pragma omp parallel for schedule(dynamic) num_threads(threads)
    for (std::int64_t bh = 0; bh < B * H; ++bh) {
      try {
        const std::int64_t b = bh / H, h = bh % H, hk = h / (H / Hkv);
        ql::head hd;
        hd.q = head_slice(q, b, h);
        hd.k = head_slice(k, b, hk);
        hd.v = head_slice(v, b, hk);
        hd.scale = scale;
        hd.causal = o.causal;
        const ql::matrix s = ql::scores(hd);
        const ql::matrix p = ql::full_probabilities(hd);
        const ql::matrix exact = ql::matmul(p, hd.v);
        std::vector<char> has_keys(static_cast<std::size_t>(Lq));
        for (std::int64_t i = 0; i < Lq; ++i) has_keys[static_cast<std::size_t>(i)] = ql::visible_keys(i, Lq, Lk, o.causal) > 0;
        const auto stream = static_cast<std::uint64_t>(bh);
        for (std::size_t pi = 0; pi < patterns.size(); ++pi) {
          const std::vector<std::int64_t> budget = ql::row_budgets(hd, patterns[pi]);
          const std::int64_t features = ql::nm_budget(Lk, patterns[pi]);
          for (std::size_t mi = 0; mi < methods.size(); ++mi) {
            const ql::method m = methods[mi];
            if (unsupported(m)) continue;
            cell& c = per_head[static_cast<std::size_t>(bh)][pi * methods.size() + mi];
            ql::key_sets keep;
            ql::matrix approx;
            const std::uint64_t method_stream = stream * 8 + static_cast<std::uint64_t>(m);
            switch (m) {
              case ql::method::dfss: {
                keep = ql::select_nm(s, patterns[pi]);
                approx = output_slice(kernel_out[pi], Lq, H, d, b, h);
                const ql::matrix function = ql::sparse_attention(hd, keep);
                c.function_err.add(function, exact);
                c.kernel_vs_function.add(approx, function);
                break;
              }
              case ql::method::topk: keep = ql::select_topk(s, budget); break;
              case ql::method::window: keep = ql::select_window(Lq, Lk, o.causal, budget); break;
              case ql::method::random: keep = ql::select_random(Lq, Lk, o.causal, budget, o.seed, method_stream); break;
              case ql::method::bigbird: keep = ql::select_bigbird(Lq, Lk, o.causal, budget, o.seed, method_stream); break;
              case ql::method::performer: approx = ql::performer_attention(hd, features, o.seed, method_stream); break;
              case ql::method::nystrom: approx = ql::nystrom_attention(hd, features); break;
            }
            if (ql::is_sparse(m) && m != ql::method::dfss) approx = ql::sparse_attention(hd, keep);
            c.err.add(approx, exact);
            const std::vector<double> mass = ql::is_sparse(m) ? ql::kept_mass(p, keep) : std::vector<double>{};
            for (std::int64_t i = 0; i < Lq; ++i) {
              if (!has_keys[static_cast<std::size_t>(i)]) continue;
              c.cos.push_back(ql::cosine(approx.row(i), exact.row(i), d));
              if (ql::is_sparse(m)) c.mass.push_back(mass[static_cast<std::size_t>(i)]);
            }
          }
        }
      } catch (...) {
        // An exception must not leave an OpenMP region: it is kept and rethrown after the loop.
        failures[static_cast<std::size_t>(bh)] = std::current_exception();
      }
    }
    for (const auto& f : failures) {
      if (f) std::rethrow_exception(f);
    }

    std::vector<table_row> rows;
    const double nan = std::numeric_limits<double>::quiet_NaN();
    for (std::size_t pi = 0; pi < patterns.size(); ++pi) {
      const std::int64_t full_budget = ql::nm_budget(Lk, patterns[pi]);
      for (std::size_t mi = 0; mi < methods.size(); ++mi) {
        const ql::method m = methods[mi];
        cell total;
        for (const auto& ph : per_head) total.merge(ph[pi * methods.size() + mi]);
        table_row r;
        r.pattern = patterns[pi].str();
        r.method = ql::method_name(m);
        r.sparse = ql::is_sparse(m);
        r.budget = m == ql::method::nystrom ? std::min({full_budget, Lq, Lk}) : full_budget;
        if (unsupported(m)) {
          r.supported = false;
          r.reason = "Nystromformer has no causal form";
          r.rel_error = r.cosine = r.mass_mean = r.mass_p5 = nan;
        } else {
          r.rel_error = total.err.relative();
          r.cosine = ql::mean(total.cos);
          r.mass_mean = r.sparse ? ql::mean(total.mass) : nan;
          r.mass_p5 = r.sparse ? ql::percentile(total.mass, 5.0) : nan;
        }
        r.function_rel_error = m == ql::method::dfss ? total.function_err.relative() : nan;
        r.kernel_vs_function = m == ql::method::dfss ? total.kernel_vs_function.relative() : nan;
        rows.push_back(r);
      }
    }

    std::ostringstream hdr;
    hdr << "dfss quality: B=" << B << " Lq=" << Lq << " Lk=" << Lk << " H=" << H << " Hkv=" << Hkv << " d=" << d
        << " " << dtype_name(q.type) << ", scale " << scale << (o.causal ? ", causal" : ", non-causal") << ", seed "
        << o.seed << "\n"
        << "exact: fp64 full softmax attention; dfss rows: the library's kernel " << sel.name << "\n";
    std::cout << hdr.str();
    std::printf("%-8s %-10s %-16s %10s %8s %9s %8s\n", "pattern", "method", "budget", "rel_err", "cosine",
                "mass_mean", "mass_p5");
    for (const auto& r : rows) {
      const std::string budget = std::to_string(r.budget) +
                                 (r.sparse ? (o.causal ? " keys/row max" : " keys/row")
                                           : (r.method == "performer" ? " features" : " landmarks"));
      if (!r.supported) {
        std::printf("%-8s %-10s %-16s unsupported: %s\n", r.pattern.c_str(), r.method.c_str(), budget.c_str(),
                    r.reason.c_str());
        continue;
      }
      std::printf("%-8s %-10s %-16s %10s %8s %9s %8s\n", r.pattern.c_str(), r.method.c_str(), budget.c_str(),
                  fixed(r.rel_error, 4).c_str(), fixed(r.cosine, 4).c_str(), fixed(r.mass_mean, 4).c_str(),
                  fixed(r.mass_p5, 4).c_str());
    }
    for (const auto& r : rows) {
      if (r.method == "dfss") {
        std::printf("dfss %s: fp64 DFSS function rel_err %s; kernel vs that function %s\n", r.pattern.c_str(),
                    fixed(r.function_rel_error, 4).c_str(), sci(r.kernel_vs_function).c_str());
      }
    }

    if (!o.json.empty()) {
      nlohmann::json j;
      j["inputs"] = {{"q", o.q},   {"k", o.k},         {"v", o.v},         {"B", B},
                     {"Lq", Lq},   {"Lk", Lk},         {"H", H},           {"Hkv", Hkv},
                     {"d", d},     {"dtype", dtype_name(q.type)}, {"scale", scale}, {"causal", o.causal},
                     {"seed", o.seed}};
      j["kernel"] = sel.name;
      j["rows"] = nlohmann::json::array();
      for (const auto& r : rows) {
        nlohmann::json e = {{"pattern", r.pattern},
                            {"method", r.method},
                            {"sparse", r.sparse},
                            {"supported", r.supported},
                            {"budget", r.budget},
                            {"rel_error", num(r.rel_error)},
                            {"cosine", num(r.cosine)},
                            {"mass_mean", num(r.mass_mean)},
                            {"mass_p5", num(r.mass_p5)}};
        if (!r.supported) e["reason"] = r.reason;
        if (r.method == "dfss") {
          e["function_rel_error"] = num(r.function_rel_error);
          e["kernel_vs_function_rel_error"] = num(r.kernel_vs_function);
        }
        j["rows"].push_back(e);
      }
      const std::string text = j.dump(2) + "\n";
      try {
        files::replace(o.json, {files::piece(reinterpret_cast<const unsigned char*>(text.data()), text.size())});
      } catch (const files::write_error& e) {
        return fail("--json " + o.json + ": " + e.what() + " (the file was not replaced)");
      }
    }
    return kExitOk;
  } catch (const npy::error& e) {
    return fail(e.what());
  } catch (const bad_input& e) {
    return fail(e.what());
  } catch (const std::invalid_argument& e) {
    return fail(e.what());
  } catch (const error& e) {
    if (e.code() == status_code::internal) throw;
    return fail(e.what());
  }
}

}  // namespace dfss::cli
