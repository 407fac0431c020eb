// The UCX configuration both ends of the ucx:// data path read (the pool's UCX side and the
// worker's), and the settings two processes must share to talk over UCX's shared memory.
//
// UCX 1.13's shared-memory transports (posix, sysv) size their FIFO elements from the local
// configuration only: a peer whose segment size (UCX_MM_SEG_SIZE, UCX_POSIX_SEG_SIZE, ...)
// differs writes past the elements or reads garbage, and the pool process dies (an assertion
// or SIGSEGV inside UCX; measured: a worker with 32 KiB segments against a pool with 8 KiB and
// the reverse both crashed the pool). So the pool reports its settings in the Handshake and a
// worker that could reach it over shared memory refuses to connect when they differ
// (docs/decisions/0021-ucx-matched-settings.md). UCX 1.13's tcp transport is alike: it sends a
// message in fragments of up to its own UCX_TCP_RX_SEG_SIZE and asserts, killing the receiving
// process, when one exceeds the receiver's (measured: a pool with 1 MiB against a worker with
// 64 KiB), so the two report and compare that too.
#pragma once

#include <ucp/api/ucp.h>

#include <cstdint>
#include <initializer_list>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace dd::kvpool {

// A UCX_TLS entry that names a shared-memory transport or alias (sm, shm, mm, posix, sysv,
// cma, xpmem, knem).
bool IsSharedMemoryTransport(absl::string_view t);
// UCX_TLS (unset: all; "a,b": those; "^a,b": all but those; aliases all, sm/shm, mm) lets UCX
// use at least one of `transports`.
bool TlsAllowsAny(std::initializer_list<absl::string_view> transports);
// UCX_TLS allows a shared-memory transport (posix, sysv, cma, xpmem, knem).
bool SharedMemoryAllowed();
// UCX_TLS allows a FIFO transport (posix, sysv, xpmem): the ones whose settings peers must share.
bool FifoTransportsAllowed();
// UCX_TLS names only shared-memory transports and self (e.g. "sm,self").
bool SharedMemoryOnly();

// The data path's shared-memory segment size, and whether the environment chose one instead
// (UCX_MM_SEG_SIZE, UCX_POSIX_SEG_SIZE or UCX_SYSV_SEG_SIZE).
inline constexpr absl::string_view kUcxSegSizeDefault = "32k";
bool UcxSegmentSizeSet();
// The largest segment UCX's FIFO transports carry: a FIFO element records its message's length
// in 16 bits, so with larger segments a full one arrives as a wrapped length and UCX kills the
// receiving process with an assertion (measured: 65535 gathers, 65536 and 64k abort the worker).
inline constexpr int64_t kUcxMaxSegBytes = 65535;
// An error naming the variable when UCX_MM_SEG_SIZE, UCX_POSIX_SEG_SIZE, UCX_SYSV_SEG_SIZE or
// UCX_XPMEM_SEG_SIZE asks for more than kUcxMaxSegBytes (UCX reads "inf" and "auto" as more) and
// UCX_TLS allows the FIFO transports; OK otherwise (a value UCX cannot read is left to UCX,
// which refuses it at ucp_init).
absl::Status CheckUcxSegmentSizes();

// The data path's tcp receive segment (the largest fragment a peer may send), and whether the
// environment chose one instead (UCX_TCP_RX_SEG_SIZE).
inline constexpr absl::string_view kUcxTcpSegSizeDefault = "1m";
bool UcxTcpSegmentSizeSet();
// That segment in bytes (UCX_TCP_RX_SEG_SIZE read as UCX reads sizes, else the default); 0 when
// UCX cannot read the setting (then UCX itself refuses it at ucp_init) or it is "inf" or "auto".
int64_t UcxTcpSegmentBytes();
// The largest get reply that goes over tcp as one eager message (ucx_protocol.h kEagerReply):
// the segment less 1 KiB for UCX's and our headers, at most 16 MiB (a request's limit); 0 when
// that leaves nothing. The worker cuts gathers to it and the pool sends no larger reply eager.
int64_t UcxEagerReplyBytes();
// The transport UCX chose for an endpoint's active messages ("tcp", "sysv", "rc_mlx5", ...;
// from ucp_ep_print_info), or "" when it cannot be told.
std::string UcxAmTransport(ucp_ep_h ep);

// UCX 1.13's tcp transport writes wherever a peer's put request says, unchecked, whatever the
// UCP context's features: any process that can reach a UCX tcp listener can write anywhere in
// the listening process (ucx_tcp_exposure_test). So the pool serves UCX over tcp only when its
// operator says the network is trusted (--ucx_tcp), and a worker loads tcp only for a pool that
// does. UCX_TLS (unset or empty: every transport) with tcp left out: "^tcp" for every
// transport, "^a,b" gains tcp, a list loses it (and "all" becomes "^tcp"); an error when
// nothing would be left (e.g. "tcp" alone).
absl::StatusOr<std::string> TlsWithoutTcp(absl::string_view tls);
// UCX_TLS names tcp itself (also as "\\tcp" or "tcp:aux"; not through "all" or an exclusion).
bool TlsNamesTcp();
// Whether UCX loaded a tcp resource into `context` (what ucp_context_print_info lists): the
// check that does not depend on parsing UCX_TLS as UCX does. Both ends fail closed on it.
bool UcxContextHasTcp(ucp_context_h context);

// Whether a data path may land gathers in CUDA device memory (GPUDirect): only when the
// operator turned it on ($DD_UCX_GPUDIRECT=on: `allowed`), only over one-sided gets (`rma`:
// active-message replies small enough to come eager are copied by the host), and only where
// the UCP context reports CUDA memory among `memory_types` (a UCX built with CUDA: Debian's
// is not).
bool UcxCudaDestinations(bool rma, uint64_t memory_types, bool allowed);
// The context's memory types (ucp_context_query; 0 when it cannot be told).
uint64_t UcxMemoryTypes(ucp_context_h context);
// $DD_UCX_GPUDIRECT: "on" → true (where UcxCudaDestinations allows); "off" or unset → false
// (until a GPU run has measured it); anything else is an error naming the variable.
absl::StatusOr<bool> UcxGpuDirectAllowed();

// UCX's configuration from the environment, with the data path's defaults: where UCX_TLS allows
// the FIFO transports, segments of 32 KiB (UCX's 8 KiB moves a reply in four times as many FIFO
// elements; 64 KiB trips an assertion in UCX 1.13) unless UCX_MM_SEG_SIZE, UCX_POSIX_SEG_SIZE
// or UCX_SYSV_SEG_SIZE is set (an error when one is too large: CheckUcxSegmentSizes); where it
// allows tcp, receive segments of 1 MiB (UCX's 64 KiB cut a 512 KiB reply into nine messages:
// 64 x 16 KiB gathers over tcp went 2.52 -> 3.89 GB/s, median of 6 alternations; resident memory
// unchanged) unless UCX_TCP_RX_SEG_SIZE is set. With `tcp` false, tcp is left out of UCX_TLS
// (TlsWithoutTcp) for this context alone. The caller releases it (ucp_config_release).
absl::StatusOr<ucp_config_t*> ReadUcxConfig(bool tcp = true);

// What a peer over UCX's shared memory must agree with, as one comparable line: UCX's version,
// the data path's segment default when it applies, and every UCX_MM_*, UCX_POSIX_*,
// UCX_SYSV_* and UCX_XPMEM_* variable set in this process, sorted; ending in kNoSharedMemory
// when UCX_TLS leaves the FIFO transports out (no peer can reach this process through them).
std::string UcxSharedMemorySettings();
inline constexpr absl::string_view kNoSharedMemory = "no shared memory";
// Two processes with these settings can talk over UCX safely: equal, or one of them cannot use
// the FIFO transports. Different spellings of one value (32k, 32K, 32768) count as different:
// the refusal names both, and the fix is to write them alike.
bool UcxSharedMemoryCompatible(absl::string_view a, absl::string_view b);

// What a peer over UCX's tcp must agree with, as one comparable line: the data path's receive
// segment when it applies and every UCX_TCP_*SEG_SIZE variable set in this process, sorted; or
// kNoTcp when UCX_TLS leaves tcp out.
std::string UcxTcpSettings();
inline constexpr absl::string_view kNoTcp = "no tcp";
// Equal, or one of them cannot use tcp (an older peer reports nothing: not compatible).
bool UcxTcpCompatible(absl::string_view a, absl::string_view b);

}  // namespace dd::kvpool
