#include "kv-pool/server/region.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/random.h"

namespace dd::kvpool {
absl::StatusOr<ShmRegion> ShmRegion::Create(const std::string& prefix, int64_t bytes, const Options& options) {
  constexpr int64_t k2M = int64_t{2} << 20;
  if (bytes <= 0) return absl::InvalidArgumentError(absl::StrCat("region size must be positive, got ", bytes));
  ShmRegion r;
  r.size_ = (bytes + k2M - 1) / k2M * k2M;
  r.name_ = absl::StrCat(prefix, "-", getpid(), "-", RandomHex());
  r.fd_ = memfd_create(r.name_.c_str(), MFD_CLOEXEC | (options.huge_pages ? MFD_HUGETLB : 0));
  if (r.fd_ < 0) return absl::InternalError(absl::StrCat("memfd_create ", r.name_, ": ", std::strerror(errno)));
  if (ftruncate(r.fd_, r.size_) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("cannot size ", r.name_, " to ", r.size_, " bytes: ", std::strerror(errno)));
  }
  void* p = mmap(nullptr, r.size_, PROT_READ | PROT_WRITE, MAP_SHARED, r.fd_, 0);
  if (p == MAP_FAILED) {
    return absl::ResourceExhaustedError(absl::StrCat("mmap of ", r.size_, " bytes", options.huge_pages ? " with huge pages" : "",
                                                     " failed: ", std::strerror(errno)));
  }
  r.data_ = static_cast<uint8_t*>(p);
  if (options.lock_memory && mlock(p, r.size_) != 0) {
    return absl::ResourceExhaustedError(absl::StrCat("mlock of ", r.size_, " bytes failed (raise RLIMIT_MEMLOCK): ",
                                                     std::strerror(errno)));
  }
  return r;
}

ShmRegion::ShmRegion(ShmRegion&& o) noexcept { *this = std::move(o); }

ShmRegion& ShmRegion::operator=(ShmRegion&& o) noexcept {
  std::swap(name_, o.name_);
  std::swap(fd_, o.fd_);
  std::swap(size_, o.size_);
  std::swap(data_, o.data_);
  return *this;
}

ShmRegion::~ShmRegion() {
  if (data_ != nullptr) munmap(data_, size_);
  if (fd_ >= 0) close(fd_);
}

RangeAllocator::RangeAllocator(int64_t size, int64_t align) : size_(size / align * align), align_(align) {
  if (size_ > 0) free_[0] = size_;
}

int64_t RangeAllocator::Allocate(int64_t bytes) {
  const int64_t need = (std::max<int64_t>(bytes, 1) + align_ - 1) / align_ * align_;
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    const int64_t off = it->first, len = it->second;
    free_.erase(it);
    if (len > need) free_[off + need] = len - need;
    allocated_[off] = need;
    used_ += need;
    return off;
  }
  return -1;
}

void RangeAllocator::Free(int64_t offset) {
  auto a = allocated_.find(offset);
  if (a == allocated_.end()) return;
  int64_t off = a->first, len = a->second;
  used_ -= len;
  allocated_.erase(a);
  auto next = free_.lower_bound(off);
  if (next != free_.end() && next->first == off + len) {
    len += next->second;
    next = free_.erase(next);
  }
  if (next != free_.begin()) {
    auto prev = std::prev(next);
    if (prev->first + prev->second == off) {
      prev->second += len;
      return;
    }
  }
  free_[off] = len;
}

}  // namespace dd::kvpool
