// `dfss attention`: attention (and optionally its backward pass) on NumPy .npy files.
#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdint>
#include <iostream>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#include "cli/commands.hpp"
#include "cli/output_paths.hpp"
#include "dfss/dfss.hpp"
#include "npy/files.hpp"
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

/// Reads an .npy input; its errors are prefixed with the flag that named it.
npy::array load(const flagged_path& in) {
  try {
    return npy::read(in.path);
  } catch (const npy::error& e) {
    throw bad_input(in.flag + ": " + e.what());
  }
}

/// Loads an attention operand: float64, float32 or float16, shaped [B, L, H, d].
npy::array load_operand(const flagged_path& in) {
  npy::array a = load(in);
  if (a.type != dtype::f64 && a.type != dtype::f32 && a.type != dtype::f16) {
    throw bad_input(in.str() + ": expected float64, float32 or float16 data, got " + dtype_name(a.type));
  }
  if (a.shape.size() != 4) {
    throw bad_input(in.str() + ": expected shape [B, L, H, d] (4 dimensions), got " + shape_str(a.shape));
  }
  return a;
}

/// A zero-filled output buffer for @p dest. Its byte count is computed with overflow checks, and a
/// failed allocation is reported naming the flag and the byte count.
npy::array make_output(const flagged_path& dest, dtype type, std::vector<std::int64_t> shape) {
  const std::string what = "the output " + shape_str(shape) + " " + dtype_name(type);
  std::size_t bytes = npy::item_size(type);
  for (const std::int64_t dim : shape) {
    if (__builtin_mul_overflow(bytes, static_cast<std::size_t>(dim), &bytes)) {
      throw bad_input(dest.str() + ": cannot allocate " + what + ": its byte count overflows 64 bits");
    }
  }
  npy::array a;
  a.type = type;
  a.shape = std::move(shape);
  try {
    a.bytes.assign(bytes, 0);
  } catch (const std::bad_alloc&) {
    throw bad_input(dest.str() + ": cannot allocate " + std::to_string(bytes) + " bytes for " + what +
                    ": out of memory");
  } catch (const std::length_error&) {
    throw bad_input(dest.str() + ": cannot allocate " + std::to_string(bytes) + " bytes for " + what +
                    ": more than a vector can hold");
  }
  return a;
}

int fail(const std::string& message) {
  std::cerr << "dfss attention: " << message << "\n";
  return kExitBadInput;
}

}  // namespace

void add_attention_command(CLI::App& app, attention_options& o) {
  CLI::App* c = app.add_subcommand("attention", "Compute DFSS attention on .npy files");
  c->footer(
      "Files: every input is loaded and checked, and the forward and backward passes run, before any output is "
      "written; then all outputs are replaced together, each atomically (a temporary file in its directory, "
      "renamed over it; the old file's mode is kept), so a failure leaves every old output as it was. An output "
      "may not name an input or another output (also through ./, .., symlinks or hard links); /dev/null and "
      "other devices and FIFOs are written in place and may take several outputs. Inputs may be pipes "
      "(e.g. /dev/stdin): read as far as the .npy header says, trailing bytes are an error. Exit codes: 0 ok, "
      "2 bad input or an output that cannot be written, 1 internal error.");
  c->add_option("--q", o.q, "queries [B, Lq, H, d] (float64, float32 or float16)")->required();
  c->add_option("--k", o.k, "keys [B, Lk, Hkv, d], same type as --q")->required();
  c->add_option("--v", o.v, "values [B, Lk, Hkv, d], same type as --q")->required();
  c->add_option("--out", o.out, "output O [B, Lq, H, d] (float64 for float64 inputs, else float32)")->required();
  c->add_option("--lse", o.lse, "optional log-sum-exp [B, H, Lq] per row");
  c->add_option("--pattern", o.pattern, "N:M pattern, e.g. 2:4, 1:2, 3:8, or dense")->capture_default_str();
  c->add_flag("--causal", o.causal, "bottom-right aligned causal mask");
  c->add_option("--scale", o.scale, "softmax scale (default 1/sqrt(d))");
  c->add_option("--key-lengths", o.key_lengths, "valid keys per batch [B] (int32 or int64), in global positions");
  c->add_option("--key-offset", o.key_offset,
                "global position of key 0, a multiple of M (the keys are a shard of a longer sequence)");
  c->add_option("--query-offset", o.query_offset,
                "global position of query row 0 per batch [B] (int32 or int64; default key offset + Lk - Lq)");
  c->add_option("--sink-tokens", o.sink_tokens, "keep whole every group touching the first N keys (fused kernels)");
  c->add_option("--recent-tokens", o.recent_tokens,
                "keep whole every group touching a row's last N visible keys (fused kernels)");
  c->add_option("--bias", o.bias, "additive bias [B or 1, H or 1, Lq, Lk] (leading 1s may be omitted)");
  c->add_option("--backend", o.backend, "automatic, reference, cpu or cuda")->capture_default_str();
  c->add_option("--threads", o.threads, "worker threads (0: all)");
  c->add_option("--algorithm", o.algorithm,
                "cpu backend: fused (single pass) or three-stage (the paper's Q K^T + selection, softmax, "
                "SpMM pipeline)")
      ->capture_default_str();
  c->add_option("--isa", o.isa, "cpu backend instruction set: automatic, generic, portable or a SIMD target (sse4, avx2, avx3, avx3_bf16, neon, sve, sve2; `dfss info` lists this build's)")->capture_default_str();
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
    cfg.key_offset = o.key_offset;
    cfg.sink_tokens = o.sink_tokens;
    cfg.recent_tokens = o.recent_tokens;
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

    // Every file read and written. Nothing is written before every input is loaded and checked and
    // the forward and backward passes have succeeded; then all outputs are replaced together.
    const flagged_path q_in{"--q", o.q}, k_in{"--k", o.k}, v_in{"--v", o.v}, lens_in{"--key-lengths", o.key_lengths},
        qoff_in{"--query-offset", o.query_offset},
        bias_in{"--bias", o.bias}, dout_in{"--dout", o.dout};
    const flagged_path out_at{"--out", o.out}, lse_at{"--lse", o.lse}, dq_at{"--dq", o.dq}, dk_at{"--dk", o.dk},
        dv_at{"--dv", o.dv}, dbias_at{"--dbias", o.dbias},
        values_at{"--save-compressed", o.save_compressed + ".values.npy"},
        indices_at{"--save-compressed", o.save_compressed + ".indices.npy"},
        meta_at{"--save-compressed", o.save_compressed + ".meta.npy"};
    const bool hw_pattern = (cfg.pattern.n == 1 && cfg.pattern.m == 2) || (cfg.pattern.n == 2 && cfg.pattern.m == 4);
    std::vector<flagged_path> inputs{q_in, k_in, v_in}, outputs{out_at};
    if (!o.key_lengths.empty()) inputs.push_back(lens_in);
    if (!o.query_offset.empty()) inputs.push_back(qoff_in);
    if (!o.bias.empty()) inputs.push_back(bias_in);
    if (backward) inputs.push_back(dout_in);
    if (!o.lse.empty()) outputs.push_back(lse_at);
    if (save_compressed) {
      outputs.push_back(values_at);
      outputs.push_back(indices_at);
      if (hw_pattern) outputs.push_back(meta_at);
    }
    if (backward) {
      for (const flagged_path& g : {dq_at, dk_at, dv_at}) outputs.push_back(g);
      if (!o.dbias.empty()) outputs.push_back(dbias_at);
    }
    if (const std::string problem = output_path_problem(inputs, outputs); !problem.empty()) return fail(problem);

    // Inputs, checked against each other before any output is allocated, so that no output is
    // larger than the inputs it comes from (with d >= 1, LSE [B, H, Lq] is at most Q's size).
    npy::array q = load_operand(q_in);
    npy::array k = load_operand(k_in);
    npy::array v = load_operand(v_in);
    if (k.type != q.type || v.type != q.type) {
      return fail(std::string("--k and --v must have the type of --q (") + dtype_name(q.type) + "), got " +
                  dtype_name(k.type) + " and " + dtype_name(v.type));
    }
    const std::int64_t B = q.shape[0], Lq = q.shape[1], H = q.shape[2], d = q.shape[3];
    const std::int64_t Lk = k.shape[1], Hkv = k.shape[2];
    if (d == 0) {
      return fail(q_in.str() + ": expected shape [B, Lq, H, d] with head_dim d = shape[3] >= 1, got " +
                  shape_str(q.shape));
    }
    if (k.shape[0] != B) {
      return fail(k_in.str() + ": expected shape[0] (batch) " + std::to_string(B) + " as in --q, got shape " +
                  shape_str(k.shape));
    }
    if (k.shape[3] != d) {
      return fail(k_in.str() + ": expected shape[3] (head_dim) " + std::to_string(d) + " as in --q, got shape " +
                  shape_str(k.shape));
    }
    if (Hkv == 0 ? H != 0 : H % Hkv != 0) {
      return fail(k_in.str() + ": expected shape[2] (heads_kv) to divide the " + std::to_string(H) +
                  " heads of --q, got shape " + shape_str(k.shape));
    }
    if (v.shape != k.shape) {
      return fail(v_in.str() + ": expected the shape of --k " + shape_str(k.shape) + ", got " + shape_str(v.shape));
    }

    npy::array lens, qoff, bias, dout;
    std::vector<std::int64_t> bias_file_shape;
    if (!o.key_lengths.empty()) {
      lens = load(lens_in);
      if (lens.type != dtype::i32 && lens.type != dtype::i64) {
        return fail(lens_in.str() + ": expected int32 or int64 data, got " + dtype_name(lens.type));
      }
      if (lens.shape != std::vector<std::int64_t>{B}) {
        return fail(lens_in.str() + ": expected shape [B] = [" + std::to_string(B) + "], got " +
                    shape_str(lens.shape));
      }
    }
    if (!o.query_offset.empty()) {
      qoff = load(qoff_in);
      if (qoff.type != dtype::i32 && qoff.type != dtype::i64) {
        return fail(qoff_in.str() + ": expected int32 or int64 data, got " + dtype_name(qoff.type));
      }
      if (qoff.shape != std::vector<std::int64_t>{B}) {
        return fail(qoff_in.str() + ": expected shape [B] = [" + std::to_string(B) + "], got " +
                    shape_str(qoff.shape));
      }
    }
    if (!o.bias.empty()) {
      bias = load(bias_in);
      if (bias.shape.size() < 2 || bias.shape.size() > 4) {
        return fail(bias_in.str() + ": expected 2 to 4 dimensions ([.., Lq, Lk]), got " + shape_str(bias.shape));
      }
      if (!dtype_is_floating(bias.type)) {
        return fail(bias_in.str() + ": expected floating-point data, got " + std::string(dtype_name(bias.type)));
      }
      // Leading broadcast dimensions may be omitted, as in NumPy: [Lq, Lk] means [1, 1, Lq, Lk].
      bias_file_shape = bias.shape;
      std::vector<std::int64_t> shape4(4, 1);
      std::copy(bias.shape.begin(), bias.shape.end(), shape4.end() - static_cast<std::ptrdiff_t>(bias.shape.size()));
      if ((shape4[0] != 1 && shape4[0] != B) || (shape4[1] != 1 && shape4[1] != H) || shape4[2] != Lq ||
          shape4[3] != Lk) {
        return fail(bias_in.str() + ": expected shape [B or 1, H or 1, Lq, Lk] = [" + std::to_string(B) + " or 1, " +
                    std::to_string(H) + " or 1, " + std::to_string(Lq) + ", " + std::to_string(Lk) +
                    "] (leading dimensions may be omitted), got " + shape_str(bias_file_shape));
      }
      bias.shape = shape4;
    }
    if (backward) {
      dout = load_operand(dout_in);
      if (dout.type != q.type) {
        return fail(std::string("--dout must have the type of --q (") + dtype_name(q.type) + "), got " + dtype_name(dout.type));
      }
      if (dout.shape != q.shape) {
        return fail(dout_in.str() + ": expected the shape of --q " + shape_str(q.shape) + ", got " +
                    shape_str(dout.shape));
      }
    }

    // Outputs. The compressed scores, [B, H, Lq, ceil(Lk/M) * N] values and indices (and for the
    // sparse tensor core patterns 1:2 and 2:4 the row-order metadata words), are the one output that
    // can exceed the inputs: make_output checks their byte count and reports a failed allocation.
    const dtype out_type = q.type == dtype::f64 ? dtype::f64 : dtype::f32;
    forward_args fa;
    fa.q = view_of(q);
    fa.k = view_of(k);
    fa.v = view_of(v);
    if (!o.key_lengths.empty()) fa.key_lengths = view_of(lens);
    if (!o.query_offset.empty()) fa.query_offset = view_of(qoff);
    if (!o.bias.empty()) fa.bias = view_of(bias);
    npy::array out = make_output(out_at, out_type, q.shape);
    fa.out = view_of(out);
    npy::array lse, cvalues, cindices, cmeta;
    if (!o.lse.empty()) {
      lse = make_output(lse_at, out_type, {B, H, Lq});
      fa.lse = view_of(lse);
    }
    if (save_compressed) {
      const std::int64_t slots = (Lk + cfg.pattern.m - 1) / cfg.pattern.m * cfg.pattern.n;
      cvalues = make_output(values_at, dtype::f32, {B, H, Lq, slots});
      cindices = make_output(indices_at, dtype::i32, {B, H, Lq, slots});
      fa.compressed_values = view_of(cvalues);
      fa.compressed_indices = view_of(cindices);
      if (hw_pattern) {
        cmeta = make_output(meta_at, dtype::u16, {B, H, Lq, (Lk + 15) / 16});
        fa.compressed_meta = view_of(cmeta);
      }
    }
    backward_args ba;
    npy::array dq, dk, dv, dbias;
    if (backward) {
      ba.q = fa.q, ba.k = fa.k, ba.v = fa.v, ba.bias = fa.bias, ba.key_lengths = fa.key_lengths;
      ba.query_offset = fa.query_offset;
      ba.out = fa.out;
      ba.dout = view_of(dout);
      dq = make_output(dq_at, out_type, q.shape);
      dk = make_output(dk_at, out_type, k.shape);
      dv = make_output(dv_at, out_type, v.shape);
      ba.dq = view_of(dq), ba.dk = view_of(dk), ba.dv = view_of(dv);
      if (!o.dbias.empty()) {
        dbias = make_output(dbias_at, bias.type, bias.shape);
        ba.dbias = view_of(dbias);
      }
    }

    // The library validates both passes (without computing) before the forward runs, so that a
    // backward the library rejects costs no forward pass.
    const std::string cannot_run = "--backend " + o.backend + ": expected a backend that can run ";
    const kernel_selection forward_kernel = select_kernel(fa, cfg);
    if (save_compressed && forward_kernel.kind != kernel_kind::cpu_three_stage_forward) {
      return fail("--save-compressed needs the cpu three-stage kernel, but this call would run " +
                  (forward_kernel.supported() ? forward_kernel.name : "nothing (" + forward_kernel.reason + ")") +
                  (q.type == dtype::f64 ? " (the cpu backend takes float32 and float16 inputs, not float64)" : ""));
    }
    if (!forward_kernel.supported()) {
      return fail(cannot_run + "this call, got backend '" + backend_name(forward_kernel.backend) +
                  "': " + forward_kernel.reason);
    }
    if (backward) {
      const kernel_selection backward_kernel = select_kernel(ba, cfg);
      if (!backward_kernel.supported()) {
        return fail(cannot_run + "the backward pass (--dout), got backend '" +
                    backend_name(backward_kernel.backend) + "': " + backward_kernel.reason);
      }
    }

    attention_forward(fa, cfg);
    if (backward) attention_backward(ba, cfg);

    files::transaction outputs_written;
    auto stage = [&outputs_written](const flagged_path& dest, const npy::array& a) {
      try {
        npy::stage(outputs_written, dest.path, a);
      } catch (const npy::error& e) {
        throw bad_input(dest.flag + ": " + e.what() + " (no output file was replaced)");
      }
    };
    stage(out_at, out);
    if (!o.lse.empty()) stage(lse_at, lse);
    if (save_compressed) {
      stage(values_at, cvalues);
      stage(indices_at, cindices);
      if (hw_pattern) stage(meta_at, cmeta);
    }
    if (backward) {
      stage(dq_at, dq);
      stage(dk_at, dk);
      stage(dv_at, dv);
      if (!o.dbias.empty()) {
        dbias.shape = bias_file_shape;  // written in the shape the bias was given in
        stage(dbias_at, dbias);
      }
    }
    outputs_written.commit();
    return kExitOk;
  } catch (const files::write_error& e) {
    return fail(std::string("cannot replace the outputs: ") + e.what());
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
