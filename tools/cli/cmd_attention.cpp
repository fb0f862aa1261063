// `dfss attention`: attention (and optionally its backward pass) on NumPy .npy files.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <iostream>
#include <optional>
#include <string>
#include <vector>

#include "cli/commands.hpp"
#include "dfss/dfss.hpp"
#include "npy/npy.hpp"
#include "cli/npy_view.hpp"

namespace dfss::cli {
namespace {

/// A user-facing input problem: reported as "dfss attention: <message>" with exit code 2.
struct bad_input : std::runtime_error {
  using std::runtime_error::runtime_error;
};

std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

/// Loads an attention operand: float64, float32 or float16, shaped [B, L, H, d].
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
  return a;
}

/// An output buffer: zero-filled bytes of the requested type and shape.
npy::array make_output(dtype type, std::vector<std::int64_t> shape) {
  npy::array a;
  a.type = type;
  a.shape = std::move(shape);
  a.bytes.assign(static_cast<std::size_t>(a.numel()) * npy::item_size(type), 0);
  return a;
}

int fail(const std::string& message) {
  std::cerr << "dfss attention: " << message << "\n";
  return kExitBadInput;
}

}  // namespace

void add_attention_command(CLI::App& app, attention_options& o) {
  CLI::App* c = app.add_subcommand("attention", "Compute DFSS attention on .npy files");
  c->add_option("--q", o.q, "queries [B, Lq, H, d] (float64, float32 or float16)")->required();
  c->add_option("--k", o.k, "keys [B, Lk, Hkv, d], same type as --q")->required();
  c->add_option("--v", o.v, "values [B, Lk, Hkv, d], same type as --q")->required();
  c->add_option("--out", o.out, "output O [B, Lq, H, d] (float64 for float64 inputs, else float32)")->required();
  c->add_option("--lse", o.lse, "optional log-sum-exp [B, H, Lq] per row");
  c->add_option("--pattern", o.pattern, "N:M pattern, e.g. 2:4, 1:2, 3:8, or dense")->capture_default_str();
  c->add_flag("--causal", o.causal, "bottom-right aligned causal mask");
  c->add_option("--scale", o.scale, "softmax scale (default 1/sqrt(d))");
  c->add_option("--key-lengths", o.key_lengths, "valid keys per batch [B] (int32 or int64)");
  c->add_option("--bias", o.bias, "additive bias [B or 1, H or 1, Lq, Lk] (leading 1s may be omitted)");
  c->add_option("--backend", o.backend, "automatic, reference, cpu or cuda")->capture_default_str();
  c->add_option("--threads", o.threads, "worker threads (0: all)");
  c->add_option("--algorithm", o.algorithm,
                "cpu backend: fused (single pass) or three-stage (the paper's Q K^T + selection, softmax, "
                "SpMM pipeline)")
      ->capture_default_str();
  c->add_option("--isa", o.isa, "cpu backend instruction set: automatic, generic or avx2")->capture_default_str();
  c->add_option("--save-compressed", o.save_compressed,
                "with --algorithm three-stage: write the compressed scores to PREFIX.values.npy (float32 "
                "[B, H, Lq, ceil(Lk/M)*N]), PREFIX.indices.npy (int32) and, for 1:2 and 2:4, PREFIX.meta.npy "
                "(uint16 [B, H, Lq, ceil(Lk/16)] metadata words)");
  c->add_option("--dout", o.dout, "upstream gradient dO [B, Lq, H, d]: also run the backward pass");
  c->add_option("--dq", o.dq, "write dQ here (with --dout)");
  c->add_option("--dk", o.dk, "write dK here (with --dout)");
  c->add_option("--dv", o.dv, "write dV here (with --dout)");
  c->add_option("--dbias", o.dbias, "write dBias here (with --dout and --bias), same shape as --bias");
}

int run_attention(const attention_options& o) {
  try {
    attention_config cfg;
    cfg.pattern = pattern::parse(o.pattern, "--pattern");
    cfg.backend = parse_backend(o.backend, "--backend");
    cfg.scale = o.scale;
    cfg.causal = o.causal;
    cfg.num_threads = o.threads;
    cfg.cpu_algorithm = parse_cpu_algorithm(o.algorithm, "--algorithm");
    cfg.cpu_isa = parse_cpu_isa(o.isa, "--isa");
    const bool save_compressed = !o.save_compressed.empty();
    if (save_compressed && cfg.cpu_algorithm != cpu_algorithm::three_stage) {
      return fail("--save-compressed needs --algorithm three-stage (the fused kernel never forms the compressed "
                  "scores)");
    }

    const bool backward = !o.dout.empty();
    if (backward && (o.dq.empty() || o.dk.empty() || o.dv.empty())) {
      return fail("--dout needs --dq, --dk and --dv to write the gradients to");
    }
    if (!backward && (!o.dq.empty() || !o.dk.empty() || !o.dv.empty() || !o.dbias.empty())) {
      return fail("--dq, --dk, --dv and --dbias need --dout (the upstream gradient)");
    }
    if (!o.dbias.empty() && o.bias.empty()) return fail("--dbias needs --bias");

    npy::array q = load_operand(o.q, "--q");
    npy::array k = load_operand(o.k, "--k");
    npy::array v = load_operand(o.v, "--v");
    if (k.type != q.type || v.type != q.type) {
      return fail(std::string("--k and --v must have the type of --q (") + dtype_name(q.type) + "), got " +
                  dtype_name(k.type) + " and " + dtype_name(v.type));
    }
    const dtype out_type = q.type == dtype::f64 ? dtype::f64 : dtype::f32;
    const auto B = q.shape[0], Lq = q.shape[1], H = q.shape[2];

    forward_args fa;
    fa.q = view_of(q);
    fa.k = view_of(k);
    fa.v = view_of(v);
    npy::array out = make_output(out_type, q.shape);
    fa.out = view_of(out);
    npy::array lse = make_output(out_type, {B, H, Lq});
    if (!o.lse.empty()) fa.lse = view_of(lse);

    npy::array lens, bias;
    std::vector<std::int64_t> bias_file_shape;
    if (!o.key_lengths.empty()) {
      lens = npy::read(o.key_lengths);
      if (lens.type != dtype::i32 && lens.type != dtype::i64) {
        return fail("--key-lengths " + o.key_lengths + ": expected int32 or int64 data, got " + dtype_name(lens.type));
      }
      fa.key_lengths = view_of(lens);
    }
    if (!o.bias.empty()) {
      bias = npy::read(o.bias);
      if (bias.shape.size() < 2 || bias.shape.size() > 4) {
        return fail("--bias " + o.bias + ": expected 2 to 4 dimensions ([.., Lq, Lk]), got " + shape_str(bias.shape));
      }
      // Leading broadcast dimensions may be omitted, as in NumPy: [Lq, Lk] means [1, 1, Lq, Lk].
      bias_file_shape = bias.shape;
      std::vector<std::int64_t> shape4(4, 1);
      std::copy(bias.shape.begin(), bias.shape.end(), shape4.end() - static_cast<std::ptrdiff_t>(bias.shape.size()));
      bias.shape = shape4;
      if (!dtype_is_floating(bias.type)) {
        return fail("--bias " + o.bias + ": expected floating-point data, got " + std::string(dtype_name(bias.type)));
      }
      fa.bias = view_of(bias);
    }

    // The three-stage pipeline's compressed scores: [B, H, Lq, ceil(Lk/M) * N] values and indices,
    // and for the sparse tensor core patterns 1:2 and 2:4 the row-order metadata words.
    npy::array cvalues, cindices, cmeta;
    const bool hw_pattern = (cfg.pattern.n == 1 && cfg.pattern.m == 2) || (cfg.pattern.n == 2 && cfg.pattern.m == 4);
    if (save_compressed) {
      const auto Lk = k.shape[1];
      const std::int64_t slots = (Lk + cfg.pattern.m - 1) / cfg.pattern.m * cfg.pattern.n;
      cvalues = make_output(dtype::f32, {B, H, Lq, slots});
      cindices = make_output(dtype::i32, {B, H, Lq, slots});
      fa.compressed_values = view_of(cvalues);
      fa.compressed_indices = view_of(cindices);
      if (hw_pattern) {
        cmeta = make_output(dtype::u16, {B, H, Lq, (Lk + 15) / 16});
        fa.compressed_meta = view_of(cmeta);
      }
      const kernel_selection sel = select_kernel(fa, cfg);
      if (sel.kind != kernel_kind::cpu_three_stage_forward) {
        return fail("--save-compressed needs the cpu three-stage kernel, but this call would run " +
                    (sel.supported() ? sel.name : "nothing (" + sel.reason + ")") +
                    (q.type == dtype::f64 ? " (the cpu backend takes float32 and float16 inputs, not float64)" : ""));
      }
    }

    attention_forward(fa, cfg);
    npy::write(o.out, out);
    if (!o.lse.empty()) npy::write(o.lse, lse);
    if (save_compressed) {
      npy::write(o.save_compressed + ".values.npy", cvalues);
      npy::write(o.save_compressed + ".indices.npy", cindices);
      if (hw_pattern) npy::write(o.save_compressed + ".meta.npy", cmeta);
    }

    if (backward) {
      npy::array dout = load_operand(o.dout, "--dout");
      if (dout.type != q.type) {
        return fail(std::string("--dout must have the type of --q (") + dtype_name(q.type) + "), got " + dtype_name(dout.type));
      }
      backward_args ba;
      ba.q = fa.q, ba.k = fa.k, ba.v = fa.v, ba.bias = fa.bias, ba.key_lengths = fa.key_lengths;
      ba.out = fa.out;
      ba.dout = view_of(dout);
      npy::array dq = make_output(out_type, q.shape), dk = make_output(out_type, k.shape),
                 dv = make_output(out_type, v.shape);
      ba.dq = view_of(dq), ba.dk = view_of(dk), ba.dv = view_of(dv);
      npy::array dbias;
      if (!o.dbias.empty()) {
        dbias = make_output(bias.type, bias.shape);
        ba.dbias = view_of(dbias);
      }
      attention_backward(ba, cfg);
      npy::write(o.dq, dq);
      npy::write(o.dk, dk);
      npy::write(o.dv, dv);
      if (!o.dbias.empty()) {
        dbias.shape = bias_file_shape;  // written in the shape the bias was given in
        npy::write(o.dbias, dbias);
      }
    }
    return kExitOk;
  } catch (const npy::error& e) {
    return fail(e.what());
  } catch (const bad_input& e) {
    return fail(e.what());
  } catch (const error& e) {
    if (e.code() == status_code::internal) throw;
    return fail(e.what());
  }
}

}  // namespace dfss::cli
