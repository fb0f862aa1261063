// The machine description of the benchmarks (see machine.hpp).
#include "harness/machine.hpp"

#include <omp.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <csignal>
#include <cstdio>
#include <ctime>
#include <fstream>

namespace dfss::harness {

#ifndef DFSS_BENCH_SOURCE_DIR
#define DFSS_BENCH_SOURCE_DIR ""
#endif

std::string trim(std::string s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.pop_back();
  std::size_t i = 0;
  while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
  return s.substr(i);
}

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) {
    if (c == '\'') {
      out += "'\\''";
    } else {
      out += c;
    }
  }
  return out + "'";
}

std::string capture(const std::string& command, int* exit_status) {
  std::string out;
  FILE* p = popen(command.c_str(), "r");
  if (p == nullptr) {
    if (exit_status) *exit_status = -1;
    return out;
  }
  char buf[4096];
  std::size_t got;
  while ((got = std::fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, got);
  const int rc = pclose(p);
  if (exit_status) *exit_status = rc;
  return out;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line, name, family, model;
  auto value = [&line] {
    const auto colon = line.find(':');
    return colon == std::string::npos ? std::string{} : trim(line.substr(colon + 1));
  };
  while (std::getline(f, line) && line != "") {
    if (line.rfind("model name", 0) == 0) {
      name = value();
    } else if (line.rfind("cpu family", 0) == 0) {
      family = value();
    } else if (line.rfind("model", 0) == 0 && line.find(':') != std::string::npos &&
               trim(line.substr(0, line.find(':'))) == "model") {
      model = value();
    }
  }
  if (name.empty()) name = "unknown";
  if (!family.empty() && !model.empty()) name += " (family " + family + " model " + model + ")";
  return name;
}

int hardware_threads() { return omp_get_num_procs(); }

std::string load_average() {
  std::ifstream f("/proc/loadavg");
  std::string one;
  f >> one;
  return one.empty() ? "unknown" : one;
}

std::string now_utc() {
  const std::time_t t = std::time(nullptr);
  std::tm tm{};
  gmtime_r(&t, &tm);
  char buf[64];
  std::strftime(buf, sizeof buf, "%Y-%m-%d %H:%M:%S UTC", &tm);
  return buf;
}

std::string git_commit() {
  const std::string dir = DFSS_BENCH_SOURCE_DIR;
  if (dir.empty()) return {};
  const std::string q = shell_quote(dir);
  std::string head = trim(capture("git -C " + q + " rev-parse --short HEAD 2>/dev/null"));
  if (head.empty()) return {};
  if (!trim(capture("git -C " + q + " status --porcelain --untracked-files=no 2>/dev/null")).empty()) {
    head += " (uncommitted changes)";
  }
  return head;
}

coprocess::coprocess(const std::string& command) {
  int to_child[2], from_child[2];
  if (pipe(to_child) != 0) return;
  if (pipe(from_child) != 0) {
    ::close(to_child[0]);
    ::close(to_child[1]);
    return;
  }
  posix_spawn_file_actions_t actions;
  posix_spawn_file_actions_init(&actions);
  posix_spawn_file_actions_adddup2(&actions, to_child[0], STDIN_FILENO);
  posix_spawn_file_actions_adddup2(&actions, from_child[1], STDOUT_FILENO);
  for (int fd : {to_child[0], to_child[1], from_child[0], from_child[1]}) posix_spawn_file_actions_addclose(&actions, fd);
  const char* argv[] = {"sh", "-c", command.c_str(), nullptr};
  pid_t pid = -1;
  // posix_spawn, not fork: the parent may hold gigabytes of cache, which a fork would map again.
  const int rc = posix_spawn(&pid, "/bin/sh", &actions, nullptr, const_cast<char* const*>(argv), environ);
  posix_spawn_file_actions_destroy(&actions);
  ::close(to_child[0]);
  ::close(from_child[1]);
  if (rc != 0) {
    ::close(to_child[1]);
    ::close(from_child[0]);
    return;
  }
  pid_ = pid;
  old_sigpipe_ = std::signal(SIGPIPE, SIG_IGN);
  in_ = fdopen(to_child[1], "w");
  out_ = fdopen(from_child[0], "r");
}

coprocess::~coprocess() {
  if (in_ != nullptr) std::fclose(in_);  // the child reads the end of its input and exits
  close_output();
  if (pid_ > 0) {
    int st = 0;
    waitpid(pid_, &st, 0);
    std::signal(SIGPIPE, old_sigpipe_);
  }
}

void coprocess::close_output() {
  if (out_ != nullptr) std::fclose(out_);
  out_ = nullptr;
}

std::optional<std::string> coprocess::read_line(const std::string& prefix) {
  std::string line;
  while (out_ != nullptr) {
    const int c = std::fgetc(out_);
    if (c == EOF) {
      close_output();
      break;
    }
    if (c != '\n') {
      line += static_cast<char>(c);
      continue;
    }
    if (line.rfind(prefix, 0) == 0) return line.substr(prefix.size());
    line.clear();
  }
  return std::nullopt;
}

std::optional<std::string> coprocess::request(const std::string& line, const std::string& prefix) {
  if (in_ == nullptr || out_ == nullptr) return std::nullopt;
  if (std::fputs((line + "\n").c_str(), in_) == EOF || std::fflush(in_) != 0) {
    close_output();  // the child is gone (EPIPE: SIGPIPE is ignored)
    return std::nullopt;
  }
  return read_line(prefix);
}

}  // namespace dfss::harness
