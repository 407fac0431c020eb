// Clean shutdown for the service binaries: block SIGTERM/SIGINT in every thread (call before
// starting any), then wait for one on the main thread and shut down in order.
#pragma once

#include <signal.h>

namespace dd {

inline sigset_t TermSignals() {
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGTERM);
  sigaddset(&sigs, SIGINT);
  return sigs;
}

inline void BlockTermSignals() {
  const sigset_t sigs = TermSignals();
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
}

// Returns the signal that arrived.
inline int WaitForTermSignal() {
  const sigset_t sigs = TermSignals();
  int sig = 0;
  sigwait(&sigs, &sig);
  return sig;
}

}  // namespace dd
