// Atomic replacement of output files through a temporary file and rename(2); see files.hpp.
#include "npy/files.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <random>
#include <system_error>
#include <utility>

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace dfss::files {
namespace fs = std::filesystem;

namespace {

// Linux's MAXSYMLINKS: more hops than this through symbolic links is reported as a loop (ELOOP).
constexpr int kMaxSymlinkHops = 40;
// The temporary file's name adds '.', ".tmp" and 8 hex digits to the target's name; keeping at
// most 200 bytes of that name stays within NAME_MAX (255 bytes).
constexpr std::size_t kMaxTempStem = 200;
// Attempts at an unused random temporary name before giving up (each has a 2^-32 chance to clash).
constexpr int kTempAttempts = 100;

std::string errno_text(int code) { return std::strerror(code); }

std::string quoted(const fs::path& p) {
  std::string out(1, '\'');  // appended piecewise: GCC 12 warns (-Wrestrict) on "'" + std::string
  out += p.string();
  out += '\'';
  return out;
}

/// The directory a target lives in, "." for a bare file name.
fs::path directory_of(const fs::path& target) {
  fs::path dir = target.parent_path();
  return dir.empty() ? fs::path(".") : dir;
}

/// Writes every piece to @p fd; throws write_error with the byte count reached.
void write_all(int fd, std::initializer_list<piece> pieces) {
  std::size_t total = 0;
  for (const piece& p : pieces) total += p.size();
  std::size_t done = 0;
  for (const piece& p : pieces) {
    const unsigned char* data = p.data();
    std::size_t left = p.size();
    while (left > 0) {
      const ::ssize_t n = ::write(fd, data, left);
      if (n < 0 && errno == EINTR) continue;
      if (n <= 0) {
        const int code = n < 0 ? errno : EIO;
        throw write_error("write error after " + std::to_string(done) + " of " + std::to_string(total) +
                          " bytes: " + errno_text(code));
      }
      const auto step = static_cast<std::size_t>(n);
      data += step;
      left -= step;
      done += step;
    }
  }
}

/// Closes a file descriptor on scope exit unless released.
class descriptor {
 public:
  explicit descriptor(int fd) noexcept : fd_(fd) {}
  descriptor(const descriptor&) = delete;
  descriptor& operator=(const descriptor&) = delete;
  ~descriptor() {
    if (fd_ >= 0) ::close(fd_);
  }
  int get() const noexcept { return fd_; }
  /// Closes now and reports close(2)'s error (which can be a delayed write error).
  void close_checked(const std::string& what) {
    const int fd = std::exchange(fd_, -1);
    if (::close(fd) != 0) throw write_error(what + ": " + errno_text(errno));
  }

 private:
  int fd_;
};

/// Creates a new, empty temporary file next to @p target with mode 0666 under the umask.
std::pair<int, fs::path> create_temp(const fs::path& target) {
  const fs::path dir = target.parent_path();
  std::string stem(1, '.');
  stem += target.filename().string().substr(0, kMaxTempStem);
  stem += ".tmp";
  std::random_device random;
  for (int attempt = 0; attempt < kTempAttempts; ++attempt) {
    char suffix[9];
    std::snprintf(suffix, sizeof suffix, "%08x", static_cast<unsigned>(random()));
    fs::path temp = dir / (stem + suffix);
    const int fd = ::open(temp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
    if (fd >= 0) return {fd, std::move(temp)};
    if (errno != EEXIST) {
      throw write_error("cannot create a temporary file in " + quoted(directory_of(target)) + ": " +
                        errno_text(errno));
    }
  }
  throw write_error("cannot create a temporary file in " + quoted(directory_of(target)) + ": " +
                    std::to_string(kTempAttempts) + " random names were all taken");
}

/// Writes a character device, FIFO or socket in place (no temporary file, no truncation).
void write_in_place(const fs::path& target, std::initializer_list<piece> pieces) {
  descriptor fd(::open(target.c_str(), O_WRONLY | O_CLOEXEC | O_NOCTTY));
  if (fd.get() < 0) throw write_error("cannot open for writing: " + errno_text(errno));
  write_all(fd.get(), pieces);
  fd.close_checked("write error on close");
}

}  // namespace

write_error::~write_error() = default;

fs::path resolve_target(const fs::path& path) {
  fs::path p = path;
  for (int hop = 0; hop <= kMaxSymlinkHops; ++hop) {
    std::error_code ec;
    if (!fs::is_symlink(fs::symlink_status(p, ec))) return p;
    const fs::path link = fs::read_symlink(p, ec);
    if (ec) return p;
    p = link.is_absolute() ? link : p.parent_path() / link;
  }
  throw write_error("cannot resolve it: more than " + std::to_string(kMaxSymlinkHops) +
                    " symbolic links (" + errno_text(ELOOP) + ")");
}

void check_writable(const std::string& path) {
  const fs::path target = resolve_target(path);
  struct stat st {};
  if (::stat(target.c_str(), &st) == 0) {
    if (S_ISDIR(st.st_mode)) throw write_error("expected a file, got a directory");
    if (!S_ISREG(st.st_mode)) {
      if (::access(target.c_str(), W_OK) != 0) throw write_error("cannot write to it: " + errno_text(errno));
      return;
    }
  } else if (errno != ENOENT) {
    throw write_error("cannot examine it: " + errno_text(errno));
  }
  // A regular or new file is written to a temporary file in its directory and renamed.
  const fs::path dir = directory_of(target);
  if (::stat(dir.c_str(), &st) != 0) {
    throw write_error("expected an existing directory " + quoted(dir) + " to write it in, got " +
                      errno_text(errno));
  }
  if (!S_ISDIR(st.st_mode)) throw write_error("expected " + quoted(dir) + " to be a directory, got another file");
  if (::access(dir.c_str(), W_OK | X_OK) != 0) {
    throw write_error("expected a writable directory " + quoted(dir) + ", got " + errno_text(errno));
  }
}

file_id identify(const std::string& path) {
  file_id id;
  fs::path target = path;
  try {
    target = resolve_target(path);
  } catch (const write_error&) {
    // A symbolic link loop: compared by its own name (it cannot be opened anyway).
  }
  struct stat st {};
  if (::stat(target.c_str(), &st) == 0) {
    id.exists = true;
    id.regular = S_ISREG(st.st_mode);
    id.device = st.st_dev;
    id.inode = st.st_ino;
  }
  std::error_code ec;
  const fs::path absolute = fs::absolute(target, ec);
  id.resolved = fs::weakly_canonical(absolute, ec);
  if (ec) id.resolved = absolute.lexically_normal();
  return id;
}

bool same_file(const file_id& a, const file_id& b) noexcept {
  if (a.exists != b.exists) return false;
  if (a.exists) return a.device == b.device && a.inode == b.inode;
  return a.resolved == b.resolved;
}

transaction::~transaction() {
  for (const staged& s : staged_) ::unlink(s.temp.c_str());
}

void transaction::stage(const std::string& path, std::initializer_list<piece> pieces) {
  const fs::path target = resolve_target(path);
  struct stat st {};
  const bool exists = ::stat(target.c_str(), &st) == 0;
  if (!exists && errno != ENOENT) throw write_error("cannot examine it: " + errno_text(errno));
  if (exists && S_ISDIR(st.st_mode)) throw write_error("expected a file, got a directory");
  if (exists && !S_ISREG(st.st_mode)) {
    write_in_place(target, pieces);
    return;
  }
  auto [raw_fd, temp] = create_temp(target);
  descriptor fd(raw_fd);
  try {
    if (exists) {
      if (::fchmod(fd.get(), st.st_mode & 07777) != 0) {
        throw write_error("cannot give the temporary file " + quoted(temp) + " the mode of the old file: " +
                          errno_text(errno));
      }
      // Best effort, as cp -p does: only root (or a member of the group) may hand a file to its old
      // owner; otherwise the new file belongs to whoever wrote it.
      if ((st.st_uid != ::geteuid() || st.st_gid != ::getegid()) &&
          ::fchown(fd.get(), st.st_uid, st.st_gid) != 0 &&
          ::fchown(fd.get(), static_cast<uid_t>(-1), st.st_gid) != 0) {
        // Neither owner nor group can be kept: the new file belongs to the user who wrote it.
      }
    }
    write_all(fd.get(), pieces);
    if (::fsync(fd.get()) != 0) throw write_error("cannot flush it to disk (fsync): " + errno_text(errno));
    fd.close_checked("write error on close");
  } catch (...) {
    ::unlink(temp.c_str());
    throw;
  }
  staged_.push_back({std::move(temp), target});
}

void transaction::commit() {
  for (std::size_t i = 0; i < staged_.size(); ++i) {
    if (std::rename(staged_[i].temp.c_str(), staged_[i].target.c_str()) != 0) {
      const int code = errno;
      const staged failed = staged_[i];
      for (std::size_t j = i; j < staged_.size(); ++j) ::unlink(staged_[j].temp.c_str());
      staged_.clear();
      throw write_error("cannot rename the temporary file " + quoted(failed.temp) + " to " +
                        quoted(failed.target) + ": " + errno_text(code));
    }
  }
  staged_.clear();
}

void replace(const std::string& path, std::initializer_list<piece> pieces) {
  transaction t;
  t.stage(path, pieces);
  t.commit();
}

}  // namespace dfss::files
