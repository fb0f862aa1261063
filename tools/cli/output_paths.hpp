// Pre-flight checks of a command's output paths against its inputs (shared by the CLI commands).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "npy/files.hpp"

namespace dfss::cli {

/// A file named on the command line, with the flag that named it.
struct flagged_path {
  std::string flag;
  std::string path;
  /// "--q q.npy", the start of every message about this file.
  std::string str() const { return flag + " " + path; }
};

/// Checks, before anything is read or computed, that every output can be written (its directory
/// exists and is writable, it is not a directory) and that no output is an input or another output
/// under another name (./a.npy and a.npy, a symlink, a hard link), which would destroy an input or
/// lose an output. Character devices and FIFOs (/dev/null) store nothing, so they may repeat.
/// Returns the problem as "<flag> <path>: expected ..., got ...", or an empty string.
inline std::string output_path_problem(const std::vector<flagged_path>& inputs,
                                       const std::vector<flagged_path>& outputs) {
  for (const flagged_path& out : outputs) {
    try {
      files::check_writable(out.path);
    } catch (const files::write_error& e) {
      return out.str() + ": " + e.what();
    }
  }
  std::vector<files::file_id> input_ids, output_ids;
  for (const flagged_path& in : inputs) input_ids.push_back(files::identify(in.path));
  for (std::size_t i = 0; i < outputs.size(); ++i) {
    output_ids.push_back(files::identify(outputs[i].path));
    const files::file_id& id = output_ids.back();
    if (id.exists && !id.regular) continue;
    for (std::size_t j = 0; j < inputs.size(); ++j) {
      if (files::same_file(id, input_ids[j])) {
        return outputs[i].str() + ": expected an output file that is not an input, got the file of " +
               inputs[j].str() + " (it would be overwritten)";
      }
    }
    for (std::size_t j = 0; j < i; ++j) {
      if (files::same_file(id, output_ids[j])) {
        return outputs[i].str() + ": expected an output file distinct from the other outputs, got the file of " +
               outputs[j].str() + " (one output would overwrite the other)";
      }
    }
  }
  return {};
}

}  // namespace dfss::cli
