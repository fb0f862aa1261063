// npy/files.hpp: writing the tools' output files safely (shared by npy::write and every CLI writer).
//
// - Replacement is atomic: a regular (or not yet existing) target is written to a temporary file in
//   the same directory, fsync'ed and renamed over the target, so that a failed write (disk full,
//   file size limit, a crash) leaves either the previous file, byte for byte, or the new one, never
//   a truncated mix. The temporary file is removed on every failure. The new file keeps the old
//   file's permission bits (and, where permitted, its owner and group); a new file gets the mode
//   open(O_CREAT, 0666) gives under the umask. Replacing a file gives it a new inode: other hard
//   links keep the old contents, as with any editor's "save".
// - A symbolic link as the target is followed (the file it points to is replaced, the link stays).
// - Other targets (character devices such as /dev/null, FIFOs) are written in place: renaming over
//   them would replace a device node (as root) and a FIFO's reader would never see the data.
// - A transaction stages several files and renames them all only at commit(), so that a command
//   that fails while writing its third output has replaced none of its outputs.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <filesystem>
#include <initializer_list>
#include <span>
#include <stdexcept>
#include <string>
#include <vector>

namespace dfss::files {

/// @brief Raised when a path cannot be written. what() says what failed and why (strerror) and does
/// not repeat the path, so that callers can prefix it with their own flag and path.
class write_error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
  write_error(const write_error&) = default;
  write_error& operator=(const write_error&) = default;
  ~write_error() override;
};

/// @brief A contiguous range of bytes to write.
using piece = std::span<const unsigned char>;

/// @brief The file a write to @p path writes: @p path with symbolic links in its last component
/// followed (a dangling link gives the path it points to). Throws write_error on a link loop.
std::filesystem::path resolve_target(const std::filesystem::path& path);

/// @brief Checks, without writing anything, that @p path can be written: it is not a directory,
/// and its directory exists and is writable (regular or absent targets, which are replaced through
/// a temporary file there), or the existing non-regular target (/dev/null, a FIFO) is writable.
/// Throws write_error saying why not. A later write can still fail (disk full, a race).
void check_writable(const std::string& path);

/// @brief Identity of a path for detecting two names of one file.
struct file_id {
  bool exists = false;
  bool regular = false;  ///< an existing regular file
  dev_t device = 0;      ///< with inode: the existing file (hard links and symlinks compare equal)
  ino_t inode = 0;
  std::filesystem::path resolved;  ///< absolute, symlinks resolved (for paths that do not exist)
};

/// @brief The identity of @p path (never throws for a missing path; a path that cannot be examined
/// is treated as not existing).
file_id identify(const std::string& path);

/// @brief Whether @p a and @p b name the same file: the same device and inode when both exist, the
/// same resolved path when neither does.
bool same_file(const file_id& a, const file_id& b) noexcept;

/// @brief Writes several files all or nothing (see the file comment).
class transaction {
 public:
  transaction() = default;
  transaction(const transaction&) = delete;
  transaction& operator=(const transaction&) = delete;
  /// Removes the temporary files of a transaction that was not committed.
  ~transaction();

  /// @brief Regular or absent target: writes @p pieces (concatenated) to a new temporary file in
  /// the target's directory and fsyncs it. Other targets are written in place, now.
  /// Throws write_error; the temporary file of a failed stage is removed at once.
  void stage(const std::string& path, std::initializer_list<piece> pieces);

  /// @brief Renames every staged temporary file onto its target, in staging order. Throws
  /// write_error if a rename fails (earlier renames stay done; later temporary files are removed).
  void commit();

 private:
  struct staged {
    std::filesystem::path temp, target;
  };
  std::vector<staged> staged_;
};

/// @brief Atomically replaces (or writes in place, see above) one file: stage + commit.
void replace(const std::string& path, std::initializer_list<piece> pieces);

}  // namespace dfss::files
