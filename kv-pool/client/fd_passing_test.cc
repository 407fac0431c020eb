// The region-descriptor socket against idle, dripping and foreign clients: a worker's request
// is answered while 50 idle connections and a one-byte drip are open; an idle client is closed
// when its time is up; a user the pool does not allow gets nothing; a pool that never answers
// is reported as a timeout, not as an unknown token.
#include "kv-pool/client/fd_passing.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <vector>

#include "gtest/gtest.h"

namespace dd::kvpool {
namespace {

constexpr char kToken[] = "the-tenant-token-0123456789";

class FdServerTest : public ::testing::Test {
 protected:
  void SetUp() override { region_ = memfd_create("dd-fd-test", MFD_CLOEXEC); }
  void TearDown() override { close(region_); }
  std::unique_ptr<FdServer> Start(std::vector<uint32_t> uids = {}) {
    auto s = FdServer::Start("", [this](absl::string_view t) { return t == kToken ? region_ : -1; }, std::move(uids));
    EXPECT_TRUE(s.ok()) << s.status();
    return std::move(*s);
  }
  // A connected client socket (nothing sent).
  static int Connect(const std::string& address) {
    sockaddr_un a{};
    a.sun_family = AF_UNIX;
    std::memcpy(a.sun_path, address.data(), address.size());
    a.sun_path[0] = '\0';  // abstract
    const int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    const auto len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size());
    EXPECT_EQ(connect(s, reinterpret_cast<const sockaddr*>(&a), len), 0) << std::strerror(errno);
    return s;
  }
  int region_ = -1;
};

TEST_F(FdServerTest, IdleAndDrippingClientsDelayNoOne) {
  auto server = Start();
  std::vector<int> idle;
  for (int i = 0; i < 50; ++i) idle.push_back(Connect(server->address()));
  const int drip = Connect(server->address());
  ASSERT_EQ(send(drip, "t", 1, MSG_NOSIGNAL), 1);
  const auto t0 = std::chrono::steady_clock::now();
  auto fd = ReceiveRegionFd(server->address(), kToken);
  const auto waited = std::chrono::steady_clock::now() - t0;
  ASSERT_TRUE(fd.ok()) << fd.status();
  EXPECT_LT(waited, std::chrono::seconds(1));
  close(*fd);
  for (int s : idle) close(s);
  close(drip);
}

TEST_F(FdServerTest, AnIdleClientIsClosedWhenItsTimeIsUp) {
  auto server = Start();
  const int s = Connect(server->address());
  pollfd p{s, POLLIN, 0};
  ASSERT_EQ(poll(&p, 1, 10000), 1) << "the server kept an idle client over 10 s";
  char byte;
  EXPECT_EQ(read(s, &byte, 1), 0);  // closed, nothing sent
  close(s);
}

TEST_F(FdServerTest, AUserThePoolDoesNotAllowGetsNothing) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root to act as another user";
  for (bool allowed : {false, true}) {
    auto server = Start(allowed ? std::vector<uint32_t>{65534} : std::vector<uint32_t>{});
    const pid_t pid = fork();
    if (pid == 0) {
      if (setgid(65534) != 0 || setuid(65534) != 0) _exit(3);
      auto fd = ReceiveRegionFd(server->address(), kToken);
      if (fd.ok()) _exit(0);
      _exit(fd.status().code() == absl::StatusCode::kPermissionDenied ? 1 : 2);
    }
    int status = 0;
    ASSERT_EQ(waitpid(pid, &status, 0), pid);
    ASSERT_TRUE(WIFEXITED(status));
    EXPECT_EQ(WEXITSTATUS(status), allowed ? 0 : 1) << (allowed ? "allowed uid refused" : "foreign uid served");
  }
}

TEST_F(FdServerTest, APoolThatNeverAnswersIsATimeout) {
  // A socket that listens but never accepts: the connection waits in the backlog.
  const std::string address = "@dd-fd-test-silent-" + std::to_string(getpid());
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  std::memcpy(a.sun_path, address.data(), address.size());
  a.sun_path[0] = '\0';
  const int l = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_EQ(bind(l, reinterpret_cast<const sockaddr*>(&a),
                 static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + address.size())), 0);
  ASSERT_EQ(listen(l, 4), 0);
  auto fd = ReceiveRegionFd(address, kToken);
  EXPECT_EQ(fd.status().code(), absl::StatusCode::kDeadlineExceeded) << fd.status();
  EXPECT_NE(fd.status().message().find("no answer"), std::string::npos) << fd.status();
  close(l);
}

}  // namespace
}  // namespace dd::kvpool
