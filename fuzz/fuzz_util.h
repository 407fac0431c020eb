// Helpers for the fuzz targets (fuzz/README.md): the readers under test take paths, so an
// input is written to an anonymous memory file and passed as /proc/self/fd/N.
#pragma once

#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <string>

namespace dd::fuzz {

class MemFile {
 public:
  MemFile(const uint8_t* data, size_t size) : fd_(memfd_create("dd-fuzz", MFD_CLOEXEC)) {
    // Private like the credential files the readers insist on (they refuse group/other access).
    if (fd_ < 0 || fchmod(fd_, 0600) != 0) std::abort();
    size_t done = 0;
    while (done < size) {
      const ssize_t n = write(fd_, data + done, size - done);
      if (n <= 0) std::abort();
      done += static_cast<size_t>(n);
    }
  }
  ~MemFile() { close(fd_); }
  MemFile(const MemFile&) = delete;
  MemFile& operator=(const MemFile&) = delete;
  std::string path() const { return "/proc/self/fd/" + std::to_string(fd_); }

 private:
  int fd_;
};

// A check that holds for every input; a failure is a finding (abort: the fuzzer saves it).
inline void Require(bool ok, const char* what) {
  if (!ok) {
    fprintf(stderr, "fuzz invariant broken: %s\n", what);
    std::abort();
  }
}

}  // namespace dd::fuzz
