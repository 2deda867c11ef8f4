// Shared-memory collectives among the ranks of one host, registered as torch custom ops in the
// namespace `adaptdist` (torch.ops.adaptdist.*). The Python side (adaptdist/kernels/shm.py) does the
// rendezvous (one rank creates the segment, the group's gloo process group tells the others its name)
// and documents the API; this file holds the segment layout, the waiting and the data movement.
//
// Segment layout (one POSIX shared-memory object per group):
//   Header (magic, group size, slot size, abort record, one cache line per rank for its pid / global
//   rank / attach flag, one cache line per rank for its arrival counter and op signatures)
//   data: kBuffers buffers x group_size slots x slot_bytes. Most collectives move their payload in "uses"
//   of at most one slot per rank; use u works in buffer u % 2, so a rank may write use u + 1 while slower
//   peers still read use u, and every use has a group-wide barrier before its buffer is reused. The large
//   all_reduce pipelines over its parity buffer and buffers 2-4, one barrier per chunk (see there).
//   outputs: group_size regions of kSharedOutBytes, rank r's all_reduce outputs (tensors whose memory is
//   the segment, so that the peers write their reduced slices straight into them; touched as used).
//   inputs: group_size regions of kSharedInBytes, rank r's registered all_reduce inputs (tensors the caller
//   fills, _shm_group_input_buffer; the peers read them in place, so the copy-in is skipped; touched as used).
//
// Synchronisation: rank r's arrival counter counts the barriers it has entered (it names who is missing),
// and the group's `arrivals` counts every rank's entries: all ranks entered their k-th barrier once it
// reaches k x n. A barrier stores the rank's counter, adds one arrival, and waits for k x n: a bounded
// spin (spin_ns), then sleeps on `arrivals` with futex (FUTEX_WAIT on a shared mapping). Only the last
// arriver wakes the sleepers, and only when `arrival_waiters` says there are any: one wake-up per waiting
// rank and barrier, not one per peer (4 ranks on 2 cores pay a context switch for each). While sleeping a
// rank wakes every <= 50 ms to check the abort record, whether the missing peers' processes are alive,
// and the collective timeout.
//
// Summation order (all_reduce, reduce_scatter; sum/avg/max): every element is reduced by exactly one
// rank, in group-rank order 0, 1, ..., n-1, accumulating in float32 (for bfloat16/float16 inputs too)
// and rounding once to the tensor's dtype; avg divides that float32 sum by n before rounding. So every
// rank receives bitwise the same result, independent of message size, chunking and timing.

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define ADAPTDIST_PAUSE() _mm_pause()
#else
#define ADAPTDIST_PAUSE() ((void)0)
#endif

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <thread>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <type_traits>
#include <vector>

namespace adaptdist_shm {

constexpr uint64_t kMagic = 0x34304d4853444441ULL;  // "ADDSHM04" (04: registered all_reduce input regions)
constexpr int kMaxRanks = 64;
constexpr size_t kAlign = 64;
constexpr int kBuffers = 5;  // slice boundaries on cache lines: no false sharing between owners
// Outputs from this size on are written with non-temporal stores (they exceed the caches this data
// would stay in; glibc's memcpy switches at 3/4 of the L3 share for the same reason).
constexpr size_t kStreamBytes = size_t(4) << 20;
// The pipelined all_reduce's chunk (at most a slot): its working set, n x chunk per buffer, stays in the
// caches between a rank's copy-in and its peers' reads. Measured (benchmarks/RESULTS.md, 2 and 4 ranks,
// 16 MiB): 1 MiB chunks do the same work in 60-75% of the time 4 MiB chunks take.
constexpr size_t kAllReduceChunkBytes = size_t(1) << 20;
constexpr size_t kReuseBytes = size_t(256) << 10;  // all_reduce outputs from this size on are reused
// The copy-in of a large (kStreamBytes or more) all_reduce from a plain tensor into the slots: which stores win
// depends on where the host put the ranks' cores. Sharing a cache, ordinary stores leave the lines there for the
// peer to read (non-temporal ones 10-15% slower); apart (the VM's vCPUs on different CCDs: whole runs in that
// mode), a peer reads a line another core just wrote only across the fabric, and non-temporal stores through
// memory took 1.10 ms where ordinary ones took 3.7-4.9 (2 ranks, 16 MiB; benchmarks/RESULTS.md, 2026-12-04 21:2x).
// So each rank measures: the first kCopyinProbe calls of every kCopyinCycle alternate the two kinds, and the rest
// use the one whose calls took less time per byte. Each rank decides alone: the kind changes no byte of any result,
// only this rank's stores.
constexpr int64_t kCopyinCycle = 512;
constexpr int64_t kCopyinProbe = 16;
// Each rank's region of the segment for its all_reduce outputs (virtual: tmpfs allocates pages as they are
// touched). Outputs up to this size from kReuseBytes on live there when the region is free; the peers then
// write the reduced slices into them directly (no copy-out pass: 14 instead of 18 x S bytes moved by 4 ranks).
constexpr size_t kSharedOutBytes = size_t(64) << 20;
// Each rank's registered input region (as NCCL's user-buffer registration): an all_reduce whose input lies in it,
// at the same offset on every rank, is reduced straight from the ranks' regions (no copy-in into the slots).
constexpr size_t kSharedInBytes = size_t(64) << 20;
// /dev/shm is a tmpfs: a page of the segment is allocated when first touched, and a touch past the space left
// raises SIGBUS (Docker's default /dev/shm is 64 MiB, shared by every group and job of the container). So nothing
// is touched before it is reserved with fallocate (whose failure is an error code, not a signal): the header and
// the slots when the group is made (rank 0; ENOSPC: a typed error), a range of an output or input region before
// its first use, in granules of kReserveGranule (one bit each of a region's mask; the syscall is paid once).
constexpr size_t kReserveGranule = size_t(1) << 20;
static_assert(kSharedOutBytes / kReserveGranule <= 64 && kSharedInBytes / kReserveGranule <= 64,
              "a region's reserved granules fit one 64-bit mask");
// In the messages of errors caused by too little /dev/shm: adaptdist/kernels/shm.py raises ShmCapacityError for them.
constexpr const char* kCapacityTag = "[shm_capacity]";

struct alignas(64) RankInfo {
  std::atomic<int32_t> pid;
  std::atomic<int32_t> global_rank;
  std::atomic<uint32_t> attached;
};

struct alignas(64) Counter {
  std::atomic<uint32_t> seq;        // barriers entered by this rank
  std::atomic<uint64_t> sig[2];     // signature of the collective in each half (mismatch check)
  std::atomic<uint32_t> shared[2];  // this rank's all_reduce output in each half: its offset in the shared region + 1, or 0
  std::atomic<uint64_t> reg[2];     // registered all_reduce input in each half: its offset in the region + 1, or 0
};

struct Header {
  uint64_t magic;
  uint32_t group_size;
  uint32_t reserved;
  uint64_t slot_bytes;
  uint64_t data_offset;
  alignas(64) std::atomic<uint32_t> abort_state;  // 0: fine, 1: being written, 2: set
  char abort_msg[1536];
  RankInfo ranks[kMaxRanks];
  Counter counters[kMaxRanks];
  alignas(64) std::atomic<uint32_t> arrivals;  // barrier entries of all ranks (futex word)
  std::atomic<uint32_t> arrival_waiters;       // ranks sleeping on `arrivals`
};

static_assert(std::atomic<uint32_t>::is_always_lock_free, "futex words must be lock-free");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "signatures must be lock-free");

// fallocate's errors that mean "no reservations here" rather than "no room": not a tmpfs (EOPNOTSUPP), or a seccomp
// filter refusing the call (ENOSYS, EPERM; some container sandboxes). Pages then come as touched.
static bool fallocate_unsupported(int err) { return err == EOPNOTSUPP || err == ENOSYS || err == EPERM; }

static double now_s() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int64_t now_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t(ts.tv_sec) * 1000000000LL + ts.tv_nsec;
}

// Copies of large payloads into memory nobody reads soon (the output tensor) bypass the cache with
// non-temporal stores: they save the read-for-ownership of every line written (measured here: a 16 MiB
// copy at 16-20 GB/s against memcpy's 11-12). SSE2 is part of the x86-64 baseline: no dispatch needed.
static void stream_copy(char* dst, const char* src, size_t n, bool fence = true) {
#if defined(__SSE2__)
  const size_t head = std::min(n, size_t((16 - (uintptr_t(dst) & 15)) & 15));
  memcpy(dst, src, head);
  dst += head;
  src += head;
  n -= head;
  const size_t body = n & ~size_t(63);
  for (size_t i = 0; i < body; i += 64) {
    __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 16));
    __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 32));
    __m128i d = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i + 48));
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i), a);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 16), b);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 32), c);
    _mm_stream_si128(reinterpret_cast<__m128i*>(dst + i + 48), d);
  }
  memcpy(dst + body, src + body, n - body);
  if (fence) _mm_sfence();  // order the weakly ordered stores before the barrier's release
#else
  memcpy(dst, src, n);
#endif
}

static inline void copy_to(char* dst, const char* src, size_t n, bool stream) {
  if (stream)
    stream_copy(dst, src, n);
  else
    memcpy(dst, src, n);
}

static void futex_wait(std::atomic<uint32_t>* addr, uint32_t expected, double timeout_s) {
  timespec ts;
  ts.tv_sec = time_t(timeout_s);
  ts.tv_nsec = long((timeout_s - double(ts.tv_sec)) * 1e9);
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
}

static void futex_wake_all(std::atomic<uint32_t>* addr) {
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// A process is gone when kill(pid, 0) says so, or when it is a zombie (killed, not yet reaped).
static bool process_alive(int32_t pid) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  if (!stat) return true;  // no procfs: trust kill()
  std::string line;
  std::getline(stat, line);
  auto close = line.rfind(')');
  if (close != std::string::npos && close + 2 < line.size()) {
    char state = line[close + 2];
    if (state == 'Z' || state == 'X') return false;
  }
  return true;
}

// Memory for all_reduce's large outputs, reused once the caller dropped the tensor that used it.
struct OutputBlock {
  void* data = nullptr;
  size_t bytes = 0;
  std::atomic<bool> in_use{false};
  ~OutputBlock() { free(data); }
};

// The segment's mapping: unmapped when the group and every output tensor in its shared region are gone.
struct Mapping {
  void* p = nullptr;
  size_t bytes = 0;
  ~Mapping() {
    if (p != nullptr) munmap(p, bytes);
  }
};

// This rank's shared output region (see kSharedOutBytes): the [begin, end) byte ranges of the output tensors alive
// on it. The output of a registered input takes the range at its input's offset, when free, so that the buckets of
// a step in flight together each have their own; the lowering lays those out from offset 0 up. Other outputs take
// the highest free range (take_top), out of the buckets' way: a plain output at 0 made every bucket there fall
// back to the copy-in pipeline.
struct SharedOutput {
  std::shared_ptr<Mapping> map;
  char* data = nullptr;
  std::mutex mu;  // the deleter may run on any thread
  std::vector<std::pair<size_t, size_t>> used;
  bool take(size_t b, size_t e) {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& u : used)
      if (b < u.second && u.first < e) return false;
    used.emplace_back(b, e);
    return true;
  }
  // The highest free 64-byte-aligned range of `bytes` below `limit`: its offset, or SIZE_MAX when none.
  size_t take_top(size_t bytes, size_t limit) {
    std::lock_guard<std::mutex> lock(mu);
    if (bytes > limit) return SIZE_MAX;
    size_t b = (limit - bytes) & ~size_t(63);
    for (;;) {  // move below every range it overlaps, highest first
      bool moved = false;
      for (const auto& u : used)
        if (b < u.second && u.first < b + bytes) {
          if (u.first < bytes) return SIZE_MAX;
          b = (u.first - bytes) & ~size_t(63);
          moved = true;
        }
      if (!moved) break;
    }
    used.emplace_back(b, b + bytes);
    return b;
  }
  void release(size_t b) {
    std::lock_guard<std::mutex> lock(mu);
    for (size_t i = 0; i < used.size(); ++i)
      if (used[i].first == b) {
        used.erase(used.begin() + long(i));
        return;
      }
  }
};

// A thread of the group's own that runs its collectives while the calling thread sleeps (as gloo runs its
// collectives on a worker thread). On a host busier than its cores this matters: a step whose collectives ran
// on its own (computing) thread took 0.55x gloo's time-equivalent (bench_tp, 22 all_reduces a step), the same
// step with each collective handed to such a thread 1.18-1.27x (benchmarks/RESULTS.md, 2026-12-03 17:5x): the
// thread that waits in the barriers then is not the one whose computing the scheduler has charged.
// Jobs run in submission order (FIFO): a group's collectives keep the program's order whether they were started
// (the *_start ops: the caller goes on computing and waits later, shm_wait) or run to completion (the other ops).
struct CommThread {
  // What the thread's loop needs, owned by the loop too: the last reference to a group (hence to this object) may
  // go on the thread itself (a job's tensors and group released there), which then detaches and finishes alone.
  struct State {
    std::mutex m;
    std::condition_variable cv;
    std::deque<std::function<void()>> jobs;
    int unfinished = 0;  // jobs queued or running
    bool stop = false;
  };
  std::shared_ptr<State> st = std::make_shared<State>();
  std::thread th;
  CommThread() : th([s = st] { loop(s); }) {}
  static void loop(std::shared_ptr<State> s) {
    std::unique_lock<std::mutex> l(s->m);
    while (true) {
      s->cv.wait(l, [&] { return !s->jobs.empty() || s->stop; });
      if (s->jobs.empty()) return;  // stopped, and every job submitted before ran
      std::function<void()> j = std::move(s->jobs.front());
      s->jobs.pop_front();
      l.unlock();
      j();
      j = nullptr;  // release what the job held (tensors) before sleeping
      l.lock();
      --s->unfinished;
    }
  }
  // Queue f (it must not throw: callers catch into their Pending).
  void submit(std::function<void()> f) {
    {
      std::lock_guard<std::mutex> l(st->m);
      st->jobs.push_back(std::move(f));
      ++st->unfinished;
    }
    st->cv.notify_one();
  }
  // No job queued or running: a collective run on the calling thread now keeps the program's order.
  bool idle() {
    std::lock_guard<std::mutex> l(st->m);
    return st->unfinished == 0;
  }
  // Run f on the thread, after every job queued before it, and wait for it.
  void run(std::function<void()> f) {
    std::mutex dm;
    std::condition_variable dcv;
    bool done = false;
    submit([&] {
      f();
      std::lock_guard<std::mutex> l(dm);
      done = true;
      dcv.notify_one();
    });
    std::unique_lock<std::mutex> l(dm);
    dcv.wait(l, [&] { return done; });
  }
  ~CommThread() {
    {
      std::lock_guard<std::mutex> l(st->m);
      st->stop = true;
    }
    st->cv.notify_all();
    if (th.get_id() == std::this_thread::get_id())
      th.detach();  // the last reference went on this thread itself: the loop ends on its own
    else if (th.joinable())
      th.join();
  }
};

// A collective started by a *_start op and not yet waited for (shm_wait): its completion and its error.
struct Pending {
  std::mutex m;
  std::condition_variable cv;
  bool done = false;
  std::exception_ptr err;
  void finish(std::exception_ptr e) {
    std::lock_guard<std::mutex> l(m);
    err = e;
    done = true;
    cv.notify_all();
  }
  std::exception_ptr wait() {
    std::unique_lock<std::mutex> l(m);
    cv.wait(l, [&] { return done; });
    return err;
  }
};

struct Group {
  std::string name;
  std::string segment;
  int rank = 0;
  int size = 0;
  int global_rank = 0;
  double timeout_s = 120.0;
  int64_t spin_ns = 0;
  size_t slot_bytes = 0;
  size_t chunk_bytes = kAllReduceChunkBytes;  // the pipelined all_reduce's chunk ($ADAPTDIST_SHM_CHUNK_BYTES)
  size_t map_bytes = 0;
  int fd = -1;             // the segment's, kept open to reserve the regions' ranges (reserve_region)
  std::atomic<bool> no_fallocate{false};  // the file system of /dev/shm has no fallocate: nothing is reserved
  size_t outs_offset = 0;  // the regions' offsets in the segment (file offsets for fallocate)
  size_t ins_offset = 0;
  std::mutex reserve_mu;                  // the slow path of reserve_region
  std::atomic<uint64_t> out_reserved{0};  // this rank's output region: granules reserved (bit k: granule k)
  std::atomic<uint64_t> in_reserved{0};   // this rank's input region: the same
  // The last failed reservation (under reserve_mu): its missing bytes and when (s); a request missing as many bytes
  // within a second fails at once, without the syscall (a full /dev/shm would cost an fallocate every call).
  size_t failed_bytes = 0;
  double failed_at_s = -1e9;
  bool creator = false;
  bool unlinked = false;
  std::shared_ptr<Mapping> map;
  Header* hdr = nullptr;
  char* data = nullptr;
  char* outs = nullptr;  // the ranks' shared output regions
  char* ins = nullptr;   // the ranks' registered input regions
  uint32_t seq = 0;  // barriers this rank entered (mirrors its counter)
  uint64_t use = 0;  // uses so far (half = use % 2)
  std::mutex mu;     // one collective at a time per group in this process
  // Phase times of the chunked all_reduce (ns, accumulated; read and reset by _shm_group_profile):
  // copy-in, reduce, copy-out, barrier waits, whole calls, calls, calls that read registered inputs in place.
  int64_t prof[7] = {0, 0, 0, 0, 0, 0, 0};
  // The large all_reduce's copy-in store kind (see kCopyinCycle): calls so far, the probe window's call time per
  // MiB summed and counted per kind (0: memcpy, 1: non-temporal), and the kind chosen from it.
  int64_t copyin_calls = 0;
  int64_t copyin_ns_per_mib[2] = {0, 0};
  int64_t copyin_n[2] = {0, 0};
  bool copyin_nt = false;
  std::mutex out_mu;  // guards output_block: a started all_reduce allocates on the caller's thread
  std::shared_ptr<OutputBlock> output_block;  // all_reduce's large outputs (reusable_output)
  std::shared_ptr<SharedOutput> shared_output;  // this rank's region of `outs`
  std::unique_ptr<CommThread> comm;  // when set (_shm_group_set_comm_thread), the collectives run on it

  char* slot(int buf, int r) const { return data + (size_t(buf) * size + size_t(r)) * slot_bytes; }
  char* half_base(int buf) const { return data + size_t(buf) * size * slot_bytes; }
  char* out_region(int r) const { return outs + size_t(r) * kSharedOutBytes; }
  char* in_region(int r) const { return ins + size_t(r) * kSharedInBytes; }

  ~Group() {
    comm.reset();
    map.reset();  // unmaps unless an output tensor still uses the shared region
    if (creator && !unlinked) shm_unlink(segment.c_str());
    if (fd >= 0) close(fd);
  }
};

struct Registry {
  std::mutex mu;
  std::map<std::string, std::shared_ptr<Group>> groups;
};

// The process's groups, by name: collectives in FX graphs carry only the group's name.
static Registry& registry() {
  static Registry* r = new Registry();  // leaked on purpose: no destructor-order issues at exit
  return *r;
}

static std::shared_ptr<Group> find_group(const std::string& name) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  auto it = reg.groups.find(name);
  TORCH_CHECK(it != reg.groups.end(), "adaptdist shm: no shared-memory group named '", name,
              "' on this process (pid ", getpid(), "); create it on every rank of the group first with "
              "adaptdist.kernels.shm.init_group(process_group, name='", name, "') (pass the same name).");
  return it->second;
}

static std::string group_desc(const Group& g) {
  std::ostringstream os;
  os << "group '" << g.name << "' (" << g.size << " ranks; this is group rank " << g.rank << ", global rank "
     << g.global_rank << ", pid " << getpid() << ")";
  return os.str();
}

// "/dev/shm (S bytes, F free)": for the errors that lack of space causes.
static std::string shm_space_desc() {
  struct statvfs vs;
  std::ostringstream os;
  if (statvfs("/dev/shm", &vs) == 0)
    os << "/dev/shm (" << uint64_t(vs.f_blocks) * vs.f_frsize << " bytes, " << uint64_t(vs.f_bavail) * vs.f_frsize
       << " free)";
  else
    os << "/dev/shm (size unknown: " << strerror(errno) << ")";
  return os.str();
}

static std::string capacity_advice() {
  return "; use gloo for this group (--comm gloo, or --comm auto, which falls back to gloo where /dev/shm is too "
         "small), or give /dev/shm more space (e.g. `docker run --shm-size=1g`, or `mount -o remount,size=1g "
         "/dev/shm`) ";
}

// Reserve [b, e) of this rank's output (out) or input region in the segment (fallocate: tmpfs allocates the pages
// now, so touching them later cannot raise SIGBUS), rounded out to granules; granules reserved before are skipped
// (the fast path: two loads and a mask). Returns 0, or the errno of the failure (ENOSPC: /dev/shm is full; the
// range is then not used: peers write into an output range, so the owner reserves it before it declares it).
static int reserve_region(Group& g, bool out, size_t b, size_t e) {
  if (e <= b || g.no_fallocate.load(std::memory_order_relaxed)) return 0;
  const size_t g0 = b / kReserveGranule, g1 = (e + kReserveGranule - 1) / kReserveGranule;
  const uint64_t want = (g1 - g0 >= 64 ? ~uint64_t(0) : ((uint64_t(1) << (g1 - g0)) - 1)) << g0;
  std::atomic<uint64_t>& mask = out ? g.out_reserved : g.in_reserved;
  if ((mask.load(std::memory_order_acquire) & want) == want) return 0;
  std::lock_guard<std::mutex> lock(g.reserve_mu);
  const uint64_t have = mask.load(std::memory_order_relaxed);
  if ((have & want) == want) return 0;
  const size_t base = (out ? g.outs_offset + size_t(g.rank) * kSharedOutBytes
                           : g.ins_offset + size_t(g.rank) * kSharedInBytes);
  // one call over the span of missing granules (ones reserved in between are kept: fallocate leaves them be)
  size_t lo = g0, hi = g1;
  while (lo < hi && (have >> lo & 1)) ++lo;
  while (hi > lo && (have >> (hi - 1) & 1)) --hi;
  const size_t missing = (hi - lo) * kReserveGranule;
  const double t = now_s();
  if (missing >= g.failed_bytes && t - g.failed_at_s < 1.0) return ENOSPC;
  int err = 0;
  while (fallocate(g.fd, 0, off_t(base + lo * kReserveGranule), off_t((hi - lo) * kReserveGranule)) != 0) {
    err = errno;
    if (err != EINTR) break;
    err = 0;
  }
  if (fallocate_unsupported(err)) {  // not a tmpfs, or a sandbox refusing it: pages come as touched, as before
    g.no_fallocate = true;
    err = 0;
  }
  if (err == 0) {
    mask.fetch_or(want, std::memory_order_release);
  } else {
    g.failed_bytes = missing;
    g.failed_at_s = t;
  }
  return err;
}

[[noreturn]] static void throw_abort(const Group& g, const char* op) {
  std::string msg(g.hdr->abort_msg, strnlen(g.hdr->abort_msg, sizeof(g.hdr->abort_msg)));
  C10_THROW_ERROR(DistBackendError, "adaptdist shm: " + std::string(op) + " on " + group_desc(g) +
                                         " failed because the group was aborted: " + msg);
}

// Record why the group failed (first writer wins), wake every sleeper so they see it, and throw.
[[noreturn]] static void fail_peer(Group& g, const char* op, int peer, const char* what) {
  const RankInfo& info = g.hdr->ranks[peer];
  std::ostringstream os;
  os << "peer group rank " << peer << " (global rank " << info.global_rank.load() << ", pid " << info.pid.load()
     << ") " << what << " [peer_group_rank=" << peer << " peer_global_rank=" << info.global_rank.load()
     << " peer_pid=" << info.pid.load() << "]";
  std::string detail = os.str();
  uint32_t expected = 0;
  if (g.hdr->abort_state.compare_exchange_strong(expected, 1)) {
    std::string rec = detail + " (reported by group rank " + std::to_string(g.rank) + ", pid " +
                      std::to_string(getpid()) + ", in " + op + ")";
    size_t n = std::min(rec.size(), sizeof(g.hdr->abort_msg) - 1);
    memcpy(g.hdr->abort_msg, rec.data(), n);
    g.hdr->abort_msg[n] = '\0';
    g.hdr->abort_state.store(2);
  }
  futex_wake_all(&g.hdr->arrivals);
  C10_THROW_ERROR(DistBackendError, "adaptdist shm: " + std::string(op) + " on " + group_desc(g) + ": " + detail);
}

static inline bool reached(uint32_t value, uint32_t target) { return int32_t(value - target) >= 0; }

static void check_abort(const Group& g, const char* op) {
  if (g.hdr->abort_state.load(std::memory_order_acquire) == 2) throw_abort(g, op);
}

// The first peer (group-rank order) that has not entered barrier `target`, or -1.
static int first_missing(const Group& g, uint32_t target) {
  for (int r = 0; r < g.size; ++r)
    if (r != g.rank && !reached(g.hdr->counters[r].seq.load(std::memory_order_acquire), target)) return r;
  return -1;
}

// Wait until `arrivals` reaches goal (every rank entered barrier `target`): spin (bounded), then futex
// sleeps with periodic checks of the missing peers.
static void wait_arrivals(Group& g, uint32_t goal, uint32_t target, const char* op, double start_s) {
  std::atomic<uint32_t>& word = g.hdr->arrivals;
  if (reached(word.load(std::memory_order_acquire), goal)) return;
  if (g.spin_ns > 0) {
    int64_t spin_end = now_ns() + g.spin_ns;
    int i = 0;
    while (true) {
      for (int k = 0; k < 32; ++k) {
        if (reached(word.load(std::memory_order_acquire), goal)) return;
        ADAPTDIST_PAUSE();
      }
      if (++i % 8 == 0 && now_ns() > spin_end) break;
    }
  }
  // Sleeping: the abort record every wake-up; the missing peers' processes and the timeout every 50 ms.
  double next_check_s = 0.0;
  while (true) {
    check_abort(g, op);
    double t = now_s();
    if (next_check_s == 0.0) {
      next_check_s = t + 0.05;
    } else if (t >= next_check_s) {
      for (int r = 0; r < g.size; ++r) {
        if (r == g.rank || reached(g.hdr->counters[r].seq.load(std::memory_order_acquire), target)) continue;
        if (!process_alive(g.hdr->ranks[r].pid.load())) {
          if (reached(g.hdr->counters[r].seq.load(std::memory_order_acquire), target)) continue;
          fail_peer(g, op, r, "died (its process is gone)");
        }
      }
      if (t - start_s > g.timeout_s) {
        const int missing = first_missing(g, target);
        if (missing >= 0) {
          std::ostringstream os;
          os << "did not arrive within the collective timeout of " << g.timeout_s << " s (stalled)";
          fail_peer(g, op, missing, os.str().c_str());
        }
      }
      next_check_s = t + 0.05;
    }
    g.hdr->arrival_waiters.fetch_add(1);
    uint32_t v = word.load();
    if (!reached(v, goal)) futex_wait(&word, v, 0.05);
    g.hdr->arrival_waiters.fetch_sub(1);
    if (reached(word.load(std::memory_order_acquire), goal)) return;
  }
}

// Enter the next barrier and wait for every peer to enter it too.
static void barrier(Group& g, const char* op, double start_s) {
  const uint32_t target = ++g.seq;
  g.hdr->counters[g.rank].seq.store(target, std::memory_order_release);
  const uint32_t goal = target * uint32_t(g.size);  // each rank's k-th barrier adds one arrival
  // seq_cst: pairs with a sleeper's arrival_waiters increment and reload of `arrivals`.
  if (g.hdr->arrivals.fetch_add(1) + 1 == goal) {
    if (g.hdr->arrival_waiters.load() != 0) futex_wake_all(&g.hdr->arrivals);
  } else {
    wait_arrivals(g, goal, target, op, start_s);
  }
  check_abort(g, op);
}

// ---------------------------------------------------------------------------------------------
// element kernels

enum class RedOp { Sum, Avg, Max };

static RedOp parse_op(const std::string& s) {
  std::string l = s;
  std::transform(l.begin(), l.end(), l.begin(), ::tolower);
  if (l == "sum") return RedOp::Sum;
  if (l == "avg") return RedOp::Avg;
  if (l == "max") return RedOp::Max;
  TORCH_CHECK_VALUE(false, "adaptdist shm: reduce_op '", s, "' is not supported: use 'sum', 'avg' or 'max'");
}

template <typename T>
static inline float to_f(T v) {
  return static_cast<float>(v);
}

// Where a reduction's result goes: up to kMaxRanks + 1 destinations, each with ordinary or non-temporal
// stores (nt: a large output nobody reads soon; the segment's slots, read by a peer next, take ordinary ones).
// The kernels write every destination from the same registers: one pass over the sources whatever their count.
struct Dests {
  char* p[kMaxRanks + 1];
  bool nt[kMaxRanks + 1];
  int k = 0;
  void add(char* ptr, bool stream) {
    p[k] = ptr;
    nt[k] = stream;
    ++k;
  }
  // Non-temporal stores of `align` bytes (16: SSE2, 32: AVX2, 64: AVX-512) need that alignment: the kernels align
  // on the first such destination, so one whose address differs from it modulo `align` takes ordinary stores.
  int first_nt(uintptr_t align = 16) {
    int f = -1;
    for (int d = 0; d < k; ++d) {
      if (!nt[d]) continue;
      if (f < 0)
        f = d;
      else if (((reinterpret_cast<uintptr_t>(p[d]) - reinterpret_cast<uintptr_t>(p[f])) & (align - 1)) != 0)
        nt[d] = false;
    }
    return f;
  }
};

// dest[i] for every destination = reduce over r in 0..n-1 (in that order) of srcs[r][i], in float32,
// rounded once to T. A destination may be one of the sources (each element is read before it is written).
// float32 and bfloat16 have one-pass SSE2 loops (x86-64's baseline; measured 3x faster than the tiled loop
// below, which stored through an L1 tile with a fence per tile); the tiled loop takes float16, and every
// dtype where SSE2 is missing.
template <typename T>
static inline void reduce_scalar(const T* const* srcs, int n, int64_t i, const Dests& d, RedOp op) {
  float acc = to_f(srcs[0][i]);
  for (int r = 1; r < n; ++r) {
    float v = to_f(srcs[r][i]);
    acc = op == RedOp::Max ? ((v > acc || v != v) ? v : acc) : acc + v;
  }
  if (op == RedOp::Avg) acc = acc / float(n);
  const T res = static_cast<T>(acc);
  for (int k = 0; k < d.k; ++k) reinterpret_cast<T*>(d.p[k])[i] = res;
}

template <typename T>
static void reduce_tiled(const T* const* srcs, int n, int64_t len, Dests d, RedOp op) {
  constexpr int64_t kTile = 1024;
  alignas(64) float acc[kTile];
  alignas(64) T res[kTile];
  const float inv_n = float(n);
  bool any_nt = false;
  for (int k = 0; k < d.k; ++k) any_nt = any_nt || d.nt[k];
  for (int64_t t0 = 0; t0 < len; t0 += kTile) {
    const int64_t m = std::min(kTile, len - t0);
    const T* s0 = srcs[0] + t0;
    for (int64_t i = 0; i < m; ++i) acc[i] = to_f(s0[i]);
    for (int r = 1; r < n; ++r) {
      const T* s = srcs[r] + t0;
      if (op == RedOp::Max) {
        for (int64_t i = 0; i < m; ++i) {
          float v = to_f(s[i]);
          acc[i] = (v > acc[i] || v != v) ? v : acc[i];
        }
      } else {
        for (int64_t i = 0; i < m; ++i) acc[i] += to_f(s[i]);
      }
    }
    if (op == RedOp::Avg)
      for (int64_t i = 0; i < m; ++i) acc[i] = acc[i] / inv_n;
    for (int64_t i = 0; i < m; ++i) res[i] = static_cast<T>(acc[i]);
    const size_t tile_bytes = size_t(m) * sizeof(T);
    for (int k = 0; k < d.k; ++k) {
      char* dst = d.p[k] + size_t(t0) * sizeof(T);
      if (d.nt[k])
        stream_copy(dst, reinterpret_cast<const char*>(res), tile_bytes, false);
      else
        memcpy(dst, res, tile_bytes);
    }
  }
#if defined(__SSE2__)
  if (any_nt) _mm_sfence();
#endif
}

#if defined(__SSE2__)
template <RedOp OP>
static inline __m128 red4(__m128 acc, __m128 x) {
  if constexpr (OP == RedOp::Max) {  // x if (x > acc or x is NaN), else acc: the scalar rule, lane-wise
    const __m128 take = _mm_or_ps(_mm_cmpgt_ps(x, acc), _mm_cmpunord_ps(x, x));
    return _mm_or_ps(_mm_and_ps(take, x), _mm_andnot_ps(take, acc));
  } else {
    return _mm_add_ps(acc, x);
  }
}

// Store 64 bytes (4 x 16) at byte offset `at` of every destination.
static inline void store64(const Dests& d, size_t at, __m128i v0, __m128i v1, __m128i v2, __m128i v3) {
  for (int k = 0; k < d.k; ++k) {
    __m128i* o = reinterpret_cast<__m128i*>(d.p[k] + at);
    if (d.nt[k]) {
      _mm_stream_si128(o, v0);
      _mm_stream_si128(o + 1, v1);
      _mm_stream_si128(o + 2, v2);
      _mm_stream_si128(o + 3, v3);
    } else {
      _mm_storeu_si128(o, v0);
      _mm_storeu_si128(o + 1, v1);
      _mm_storeu_si128(o + 2, v2);
      _mm_storeu_si128(o + 3, v3);
    }
  }
}

static inline void store32(const Dests& d, size_t at, __m128i v0, __m128i v1) {
  for (int k = 0; k < d.k; ++k) {
    __m128i* o = reinterpret_cast<__m128i*>(d.p[k] + at);
    if (d.nt[k]) {
      _mm_stream_si128(o, v0);
      _mm_stream_si128(o + 1, v1);
    } else {
      _mm_storeu_si128(o, v0);
      _mm_storeu_si128(o + 1, v1);
    }
  }
}

template <RedOp OP>
static void reduce_f32_sse2(const float* const* srcs, int n, int64_t len, Dests d) {
  const int f = d.first_nt();
  int64_t i = 0;
  if (f >= 0)  // non-temporal stores need 16-byte alignment
    for (; i < len && (reinterpret_cast<uintptr_t>(d.p[f] + i * 4) & 15) != 0; ++i)
      reduce_scalar(srcs, n, i, d, OP);
  const __m128 nv = _mm_set1_ps(float(n));
  for (; i + 16 <= len; i += 16) {
    const float* s0 = srcs[0] + i;
    __m128 a0 = _mm_loadu_ps(s0), a1 = _mm_loadu_ps(s0 + 4), a2 = _mm_loadu_ps(s0 + 8), a3 = _mm_loadu_ps(s0 + 12);
    for (int r = 1; r < n; ++r) {
      const float* s = srcs[r] + i;
      a0 = red4<OP>(a0, _mm_loadu_ps(s));
      a1 = red4<OP>(a1, _mm_loadu_ps(s + 4));
      a2 = red4<OP>(a2, _mm_loadu_ps(s + 8));
      a3 = red4<OP>(a3, _mm_loadu_ps(s + 12));
    }
    if constexpr (OP == RedOp::Avg) {
      a0 = _mm_div_ps(a0, nv);
      a1 = _mm_div_ps(a1, nv);
      a2 = _mm_div_ps(a2, nv);
      a3 = _mm_div_ps(a3, nv);
    }
    store64(d, size_t(i) * 4, _mm_castps_si128(a0), _mm_castps_si128(a1), _mm_castps_si128(a2),
            _mm_castps_si128(a3));
  }
  for (; i < len; ++i) reduce_scalar(srcs, n, i, d, OP);
  if (f >= 0) _mm_sfence();
}

// bfloat16 <-> float32 as c10 does it: widening is a 16-bit shift; narrowing rounds to nearest even and
// makes every NaN 0x7FC0 (c10::detail::round_to_nearest_even).
static inline void bf16x8_to_f32(__m128i v, __m128& lo, __m128& hi) {
  const __m128i z = _mm_setzero_si128();
  lo = _mm_castsi128_ps(_mm_unpacklo_epi16(z, v));
  hi = _mm_castsi128_ps(_mm_unpackhi_epi16(z, v));
}

static inline __m128i f32x4_to_bf16_in_u32(__m128 f) {
  const __m128i u = _mm_castps_si128(f);
  const __m128i lsb = _mm_and_si128(_mm_srli_epi32(u, 16), _mm_set1_epi32(1));
  const __m128i r = _mm_srli_epi32(_mm_add_epi32(u, _mm_add_epi32(lsb, _mm_set1_epi32(0x7FFF))), 16);
  const __m128i nan = _mm_castps_si128(_mm_cmpunord_ps(f, f));
  return _mm_or_si128(_mm_and_si128(nan, _mm_set1_epi32(0x7FC0)), _mm_andnot_si128(nan, r));
}

static inline __m128i f32x8_to_bf16(__m128 lo, __m128 hi) {
  // SSE2 packs 32 -> 16 bits with signed saturation only: shift 0..0xFFFF into int16's range and back.
  const __m128i bias = _mm_set1_epi32(0x8000);
  const __m128i p = _mm_packs_epi32(_mm_sub_epi32(f32x4_to_bf16_in_u32(lo), bias),
                                    _mm_sub_epi32(f32x4_to_bf16_in_u32(hi), bias));
  return _mm_xor_si128(p, _mm_set1_epi16(int16_t(-32768)));
}

template <RedOp OP>
static void reduce_bf16_sse2(const c10::BFloat16* const* srcs, int n, int64_t len, Dests d) {
  const int f = d.first_nt();
  int64_t i = 0;
  if (f >= 0)
    for (; i < len && (reinterpret_cast<uintptr_t>(d.p[f] + i * 2) & 15) != 0; ++i)
      reduce_scalar(srcs, n, i, d, OP);
  const __m128 nv = _mm_set1_ps(float(n));
  for (; i + 16 <= len; i += 16) {
    __m128 a0, a1, a2, a3;
    bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(srcs[0] + i)), a0, a1);
    bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(srcs[0] + i + 8)), a2, a3);
    for (int r = 1; r < n; ++r) {
      __m128 b0, b1, b2, b3;
      bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(srcs[r] + i)), b0, b1);
      bf16x8_to_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(srcs[r] + i + 8)), b2, b3);
      a0 = red4<OP>(a0, b0);
      a1 = red4<OP>(a1, b1);
      a2 = red4<OP>(a2, b2);
      a3 = red4<OP>(a3, b3);
    }
    if constexpr (OP == RedOp::Avg) {
      a0 = _mm_div_ps(a0, nv);
      a1 = _mm_div_ps(a1, nv);
      a2 = _mm_div_ps(a2, nv);
      a3 = _mm_div_ps(a3, nv);
    }
    store32(d, size_t(i) * 2, f32x8_to_bf16(a0, a1), f32x8_to_bf16(a2, a3));
  }
  for (; i < len; ++i) reduce_scalar(srcs, n, i, d, OP);
  if (f >= 0) _mm_sfence();
}

// float32 with 256- and 512-bit vectors (AVX2, AVX-512F), chosen at run time (__builtin_cpu_supports) where the
// compiler can target them; the SSE2 loop above stays for every other x86-64. Lane-wise the same IEEE operations
// in the same rank order as the SSE2 and scalar code (add, or the max rule; avg's one division): bitwise the same
// results. Measured on this host's bandwidth-bound 16 MiB calls: a few per cent at most, in paired runs only
// (benchmarks/RESULTS.md, "copy-in (plain tensor) path", 2026-12-04): fewer instructions per cache line.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define ADAPTDIST_WIDE_SIMD 1
template <RedOp OP>
__attribute__((target("avx2"))) static inline __m256 red8(__m256 acc, __m256 x) {
  if constexpr (OP == RedOp::Max) {
    const __m256 take = _mm256_or_ps(_mm256_cmp_ps(x, acc, _CMP_GT_OS), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    return _mm256_blendv_ps(acc, x, take);
  } else {
    return _mm256_add_ps(acc, x);
  }
}

template <RedOp OP>
__attribute__((target("avx2"))) static void reduce_f32_avx2(const float* const* srcs, int n, int64_t len, Dests d) {
  const int f = d.first_nt(32);  // 32-byte non-temporal stores need 32-byte alignment
  int64_t i = 0;
  if (f >= 0)
    for (; i < len && (reinterpret_cast<uintptr_t>(d.p[f] + i * 4) & 31) != 0; ++i) reduce_scalar(srcs, n, i, d, OP);
  const __m256 nv = _mm256_set1_ps(float(n));
  for (; i + 32 <= len; i += 32) {  // two cache lines per step
    const float* s0 = srcs[0] + i;
    __m256 a0 = _mm256_loadu_ps(s0), a1 = _mm256_loadu_ps(s0 + 8), a2 = _mm256_loadu_ps(s0 + 16),
           a3 = _mm256_loadu_ps(s0 + 24);
    for (int r = 1; r < n; ++r) {
      const float* s = srcs[r] + i;
      a0 = red8<OP>(a0, _mm256_loadu_ps(s));
      a1 = red8<OP>(a1, _mm256_loadu_ps(s + 8));
      a2 = red8<OP>(a2, _mm256_loadu_ps(s + 16));
      a3 = red8<OP>(a3, _mm256_loadu_ps(s + 24));
    }
    if constexpr (OP == RedOp::Avg) {
      a0 = _mm256_div_ps(a0, nv);
      a1 = _mm256_div_ps(a1, nv);
      a2 = _mm256_div_ps(a2, nv);
      a3 = _mm256_div_ps(a3, nv);
    }
    for (int k = 0; k < d.k; ++k) {
      float* o = reinterpret_cast<float*>(d.p[k] + size_t(i) * 4);
      if (d.nt[k]) {
        _mm256_stream_ps(o, a0);
        _mm256_stream_ps(o + 8, a1);
        _mm256_stream_ps(o + 16, a2);
        _mm256_stream_ps(o + 24, a3);
      } else {
        _mm256_storeu_ps(o, a0);
        _mm256_storeu_ps(o + 8, a1);
        _mm256_storeu_ps(o + 16, a2);
        _mm256_storeu_ps(o + 24, a3);
      }
    }
  }
  for (; i < len; ++i) reduce_scalar(srcs, n, i, d, OP);
  if (f >= 0) _mm_sfence();
}

template <RedOp OP>
__attribute__((target("avx512f"))) static inline __m512 red16(__m512 acc, __m512 x) {
  if constexpr (OP == RedOp::Max) {
    const __mmask16 take = _mm512_cmp_ps_mask(x, acc, _CMP_GT_OS) | _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    return _mm512_mask_blend_ps(take, acc, x);
  } else {
    return _mm512_add_ps(acc, x);
  }
}

template <RedOp OP>
__attribute__((target("avx512f"))) static void reduce_f32_avx512(const float* const* srcs, int n, int64_t len,
                                                                 Dests d) {
  const int f = d.first_nt(64);
  int64_t i = 0;
  if (f >= 0)
    for (; i < len && (reinterpret_cast<uintptr_t>(d.p[f] + i * 4) & 63) != 0; ++i) reduce_scalar(srcs, n, i, d, OP);
  const __m512 nv = _mm512_set1_ps(float(n));
  for (; i + 32 <= len; i += 32) {
    const float* s0 = srcs[0] + i;
    __m512 a0 = _mm512_loadu_ps(s0), a1 = _mm512_loadu_ps(s0 + 16);
    for (int r = 1; r < n; ++r) {
      const float* s = srcs[r] + i;
      a0 = red16<OP>(a0, _mm512_loadu_ps(s));
      a1 = red16<OP>(a1, _mm512_loadu_ps(s + 16));
    }
    if constexpr (OP == RedOp::Avg) {
      a0 = _mm512_div_ps(a0, nv);
      a1 = _mm512_div_ps(a1, nv);
    }
    for (int k = 0; k < d.k; ++k) {
      float* o = reinterpret_cast<float*>(d.p[k] + size_t(i) * 4);
      if (d.nt[k]) {
        _mm512_stream_ps(o, a0);
        _mm512_stream_ps(o + 16, a1);
      } else {
        _mm512_storeu_ps(o, a0);
        _mm512_storeu_ps(o + 16, a1);
      }
    }
  }
  for (; i < len; ++i) reduce_scalar(srcs, n, i, d, OP);
  if (f >= 0) _mm_sfence();
}
#endif

// The float32 kernel's vector width: the widest this CPU has, or $ADAPTDIST_SHM_SIMD (sse2, avx2, avx512; read once,
// for side-by-side measurements and the tests that check every width gives the same bits) where the CPU has it.
enum class Simd { Sse2, Avx2, Avx512 };
static Simd f32_simd() {
  static const Simd s = [] {
#if defined(ADAPTDIST_WIDE_SIMD)
    const bool has512 = __builtin_cpu_supports("avx512f"), has2 = __builtin_cpu_supports("avx2");
    const char* e = getenv("ADAPTDIST_SHM_SIMD");
    const std::string want = e ? e : "";
    if (want == "sse2") return Simd::Sse2;
    if (want == "avx2") return has2 ? Simd::Avx2 : Simd::Sse2;
    if (!want.empty() && want != "avx512")
      TORCH_WARN("adaptdist shm: ADAPTDIST_SHM_SIMD=", want, " is not one of sse2, avx2, avx512: using the widest");
    return has512 ? Simd::Avx512 : has2 ? Simd::Avx2 : Simd::Sse2;
#else
    return Simd::Sse2;
#endif
  }();
  return s;
}

template <template <RedOp> class K, typename... A>
static void with_op(RedOp op, A... a) {
  if (op == RedOp::Sum)
    K<RedOp::Sum>::run(a...);
  else if (op == RedOp::Avg)
    K<RedOp::Avg>::run(a...);
  else
    K<RedOp::Max>::run(a...);
}
template <RedOp OP>
struct F32Kernel {
  static void run(const float* const* s, int n, int64_t len, const Dests* d) {
#if defined(ADAPTDIST_WIDE_SIMD)
    const Simd w = f32_simd();
    if (w == Simd::Avx512) return reduce_f32_avx512<OP>(s, n, len, *d);
    if (w == Simd::Avx2) return reduce_f32_avx2<OP>(s, n, len, *d);
#endif
    reduce_f32_sse2<OP>(s, n, len, *d);
  }
};
template <RedOp OP>
struct BF16Kernel {
  static void run(const c10::BFloat16* const* s, int n, int64_t len, const Dests* d) {
    reduce_bf16_sse2<OP>(s, n, len, *d);
  }
};
#endif

static void reduce_to(at::ScalarType dt, const char* const* srcs, int n, int64_t len, const Dests& d, RedOp op) {
  switch (dt) {
    case at::kFloat: {
      auto s = reinterpret_cast<const float* const*>(srcs);
#if defined(__SSE2__)
      with_op<F32Kernel>(op, s, n, len, &d);
#else
      reduce_tiled<float>(s, n, len, d, op);
#endif
      break;
    }
    case at::kBFloat16: {
      auto s = reinterpret_cast<const c10::BFloat16* const*>(srcs);
#if defined(__SSE2__)
      with_op<BF16Kernel>(op, s, n, len, &d);
#else
      reduce_tiled<c10::BFloat16>(s, n, len, d, op);
#endif
      break;
    }
    case at::kHalf:
      reduce_tiled<c10::Half>(reinterpret_cast<const c10::Half* const*>(srcs), n, len, d, op);
      break;
    default:
      TORCH_CHECK(false, "unreachable dtype");
  }
}

// One destination, out1, with non-temporal stores when stream1.
static void reduce_dispatch(at::ScalarType dt, const char* const* srcs, int n, int64_t len, char* out1, RedOp op,
                            bool stream1 = false) {
  Dests d;
  d.add(out1, stream1);
  reduce_to(dt, srcs, n, len, d, op);
}

static void check_dtype(const at::Tensor& t, const char* op, bool reduces) {
  auto dt = t.scalar_type();
  bool ok = dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf;
  if (!reduces) ok = ok || dt == at::kDouble || dt == at::kLong || dt == at::kInt || dt == at::kByte ||
                     dt == at::kChar || dt == at::kBool || dt == at::kShort;
  TORCH_CHECK_TYPE(ok, "adaptdist shm: ", op, " does not support dtype ", dt,
                   reduces ? " (reductions take float32, bfloat16 or float16)" : "");
  TORCH_CHECK(t.device().is_cpu(), "adaptdist shm: ", op, " takes CPU tensors, got one on ", t.device());
}

// Partition [0, len) elements among n owners on cache-line boundaries; owner r gets [b[r], b[r+1]).
static void slice_bounds(int64_t len, int n, size_t esize, std::vector<int64_t>& b) {
  b.assign(n + 1, 0);
  const int64_t unit = std::max<int64_t>(1, int64_t(kAlign / esize));
  const int64_t units = (len + unit - 1) / unit;
  for (int r = 0; r <= n; ++r) b[r] = std::min(len, (units * r / n) * unit);
  b[n] = len;
}

static uint64_t signature(uint64_t opcode, at::ScalarType dt, int64_t numel, int64_t extra) {
  uint64_t h = 1469598103934665603ULL;
  for (uint64_t v : {opcode, uint64_t(dt), uint64_t(numel), uint64_t(extra)}) {
    h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  }
  return h;
}

static const char* op_name(uint64_t code) {
  switch (code) {
    case 1: return "all_reduce";
    case 2: return "all_gather";
    case 3: return "reduce_scatter";
    case 4: return "all_to_all";
    case 5: return "broadcast";
    default: return "?";
  }
}

// Publish this use's signature (before the barrier) and, after it, check every peer issued the same one.
struct UseGuard {
  Group& g;
  int half;
  uint64_t sig;
  UseGuard(Group& g_, uint64_t sig_) : g(g_), half(int(g_.use++ & 1)), sig(sig_) {
    g.hdr->counters[g.rank].sig[half].store(sig, std::memory_order_relaxed);
  }
  void check(const char* op, const at::Tensor& t) {
    for (int r = 0; r < g.size; ++r) {
      if (r == g.rank) continue;
      if (g.hdr->counters[r].sig[half].load(std::memory_order_relaxed) != sig) {
        std::ostringstream os;
        os << "issued a different collective than this rank's " << op << " of " << t.scalar_type() << " "
           << t.sizes()
           << " (op, dtype or size differ: the ranks' programs disagree)";
        fail_peer(g, op, r, os.str().c_str());
      }
    }
  }
};

// ---------------------------------------------------------------------------------------------
// collectives (CPU kernels)

// all_reduce's output: a fresh tensor, except that a large one lives in this rank's shared output region
// (up to kSharedOutBytes; the peers then write their reduced slices into it) or else in the group's private
// output block, when the caller dropped the last tensor there (the deleter, run when the last reference to
// that storage goes, marks it free). A fresh large buffer costs a page fault per 4 KiB page on every call
// (glibc hands big blocks back to the kernel): measured 100-1400 faults per 16 MiB call, up to a ms.
static at::Tensor reusable_output(Group& g, const at::Tensor& x) {
  const size_t bytes = size_t(x.numel()) * x.element_size();
  std::lock_guard<std::mutex> out_lock(g.out_mu);
  std::shared_ptr<SharedOutput> so = g.shared_output;
  // a registered input's output goes at the same offset of the output region (each bucket its own range)
  const char* xp = static_cast<const char*>(x.data_ptr());
  const char* in_base = g.in_region(g.rank);
  const bool reg = xp >= in_base && xp + bytes <= in_base + kSharedInBytes;
  size_t roff = SIZE_MAX;
  if (g.size > 1 && bytes >= kReuseBytes && so) {
    if (!reg)
      roff = so->take_top(bytes, kSharedOutBytes);
    else if (size_t(xp - in_base) + bytes <= kSharedOutBytes &&
             so->take(size_t(xp - in_base), size_t(xp - in_base) + bytes))
      roff = size_t(xp - in_base);
  }
  if (roff != SIZE_MAX && reserve_region(g, true, roff, roff + bytes) != 0) {
    so->release(roff);  // no space on /dev/shm for it: a private output (the peers never see this range)
    roff = SIZE_MAX;
  }
  if (roff != SIZE_MAX) {
    // The tensor keeps the mapping: it stays valid after the group is destroyed.
    return at::for_blob(so->data + roff, x.sizes())
        .deleter([so, roff](void*) { so->release(roff); })
        .options(x.options())
        .resizeable_storage()
        .allocator(c10::GetCPUAllocator())
        .make_tensor();
  }
  std::shared_ptr<OutputBlock>& blk = g.output_block;
  if (bytes < kReuseBytes || (blk && blk->in_use.load(std::memory_order_acquire)))
    return at::empty_like(x, at::MemoryFormat::Contiguous);
  if (!blk || blk->bytes < bytes) {
    blk.reset();
    auto fresh = std::make_shared<OutputBlock>();
    if (posix_memalign(&fresh->data, 64, bytes) != 0) return at::empty_like(x, at::MemoryFormat::Contiguous);
    fresh->bytes = bytes;
    blk = std::move(fresh);
  }
  blk->in_use.store(true, std::memory_order_relaxed);
  std::shared_ptr<OutputBlock> keep = blk;  // the block outlives the group while a tensor uses it
  return at::for_blob(blk->data, x.sizes())
      .deleter([keep](void*) { keep->in_use.store(false, std::memory_order_release); })
      .options(x.options())
      .resizeable_storage()
      .allocator(c10::GetCPUAllocator())
      .make_tensor();
}

// The collectives below take an optional `given` output (allocated by the *_start ops on the caller's thread);
// when undefined they allocate it.
static at::Tensor all_reduce_cpu(const at::Tensor& input, c10::string_view reduce_op, c10::string_view group_name,
                                 at::Tensor given = at::Tensor()) {
  const char* op = "all_reduce";
  check_dtype(input, op, true);
  RedOp rop = parse_op(std::string(reduce_op));
  auto gp = find_group(std::string(group_name));
  Group& g = *gp;
  std::lock_guard<std::mutex> lock(g.mu);
  check_abort(g, op);
  at::Tensor x = input.contiguous();
  at::Tensor out = given.defined() ? given : reusable_output(g, x);
  const int64_t numel = x.numel();
  if (numel == 0) return out;
  const size_t es = x.element_size();
  const at::ScalarType dt = x.scalar_type();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op_ = static_cast<char*>(out.data_ptr());
  const int n = g.size;
  const double start = now_s();
  const uint64_t sig = signature(1, dt, numel, int64_t(rop) | (int64_t(g.chunk_bytes) << 8));  // chunks must agree
  std::vector<const char*> srcs(n);
  if (n == 1) {
    srcs[0] = xp;
    reduce_dispatch(dt, srcs.data(), 1, numel, op_, rop);
    return out;
  }
  const size_t bytes = size_t(numel) * es;
  const size_t small_bytes = std::min<size_t>(g.slot_bytes, 32 * 1024);
  if (bytes <= small_bytes) {
    // One barrier: everyone publishes all of its input, everyone reduces all of it in rank order.
    UseGuard use(g, sig);
    memcpy(g.slot(use.half, g.rank), xp, bytes);
    barrier(g, op, start);
    use.check(op, x);
    for (int r = 0; r < n; ++r) srcs[r] = (r == g.rank) ? xp : g.slot(use.half, r);
    reduce_dispatch(dt, srcs.data(), n, numel, op_, rop);
    return out;
  }
  // Chunks of at most a slot. Rank r reduces slice r of every chunk: its own part straight from its input, the
  // peers' parts from their slots, where they copied them in. It writes the result into its output and
  // into the output of every peer whose output is its shared output region (declared before the first
  // barrier; the usual case for outputs of kReuseBytes..kSharedOutBytes). For a peer whose output is private
  // it also writes the result over the part it just read from peer (r+1)%n's slot (lines in its cache: no
  // read-for-ownership miss), whence that peer copies it out. A software pipeline needs one barrier per
  // chunk: phase j copies chunk j in, reduces chunk j-1, copies chunk j-2's results out (private outputs).
  // Buffers: chunk 0 goes to the parity buffer (use % 2) that the previous collective left free (slower
  // peers may still read the other one; every op writes only its parity buffer before its first barrier),
  // chunks 1, 2, 3, ... rotate over buffers 2, 3, 4. Chunk c's buffer is written in phases c (copy-in) and
  // c+1 (results), read in phases c+1 and c+2 (copy-out), and rewritten in phase c+3: a barrier separates
  // each pair. Only the last chunk's copy-out follows the final barrier; it reads buffer 2-4 (or the
  // parity buffer if there is one chunk), which the next collective writes only after its first barrier.
  // A shared output region is written by peers only between the first and the last barrier of a call whose
  // owner declared it (its tensor was free then); the owner returns after the last barrier.
  //
  // Registered input (the input lies in this rank's input region, _shm_group_input_buffer): each rank says
  // before the first barrier where (offset + 1, or 0). When every rank's input is registered at the same offset
  // (the signature already matched dtype and size) and every output is its shared region, the call is two
  // barriers: after the first, rank r reduces slice r of the whole tensor straight from every rank's input
  // region (the same summation order) into every rank's output; after the second (every peer finished reading
  // this rank's input and writing its output) it returns. Otherwise the ranks agree, from the same published
  // words, to run the pipeline; a rank that skipped chunk 0's copy-in (registered) copies it in after the first
  // barrier, and every rank then enters one extra barrier before the pipeline's reductions, so they all stay in
  // step.
  const int64_t chunk = int64_t(std::min(g.slot_bytes, g.chunk_bytes) / es);
  const int64_t nchunks = (numel + chunk - 1) / chunk;
  std::vector<std::vector<int64_t>> bounds(3);
  UseGuard use(g, sig);
  const char* out_base = g.out_region(g.rank);
  const bool mine_shared = op_ >= out_base && op_ + bytes <= out_base + kSharedOutBytes;
  g.hdr->counters[g.rank].shared[use.half].store(mine_shared ? uint32_t(op_ - out_base) + 1 : 0,
                                                 std::memory_order_relaxed);
  const char* in_base = g.in_region(g.rank);
  const bool reg_in = xp >= in_base && xp + bytes <= in_base + kSharedInBytes;
  const uint64_t reg_word = reg_in ? uint64_t(xp - in_base) + 1 : 0;
  g.hdr->counters[g.rank].reg[use.half].store(reg_word, std::memory_order_relaxed);
  std::vector<uint32_t> peer_shared(n, 0);  // each peer's output offset in its shared region + 1, or 0 (after barrier 1)
  bool slot_results = false;            // some peer's output is private: results also go to the slots
  auto in_buf = [&](int64_t c) { return c == 0 ? use.half : int(2 + (c - 1) % 3); };
  const bool stream = bytes >= kStreamBytes;
  const int64_t cycle = stream ? g.copyin_calls++ % kCopyinCycle : -1;
  if (cycle == 0) {
    g.copyin_ns_per_mib[0] = g.copyin_ns_per_mib[1] = 0;
    g.copyin_n[0] = g.copyin_n[1] = 0;
  }
  const bool probing = cycle >= 0 && cycle < kCopyinProbe;
  const bool nt_copy = stream && (probing ? cycle % 2 == 1 : g.copyin_nt);
  const int64_t t_call = now_ns();
  int64_t t_phase = t_call;
  auto lap = [&](int k) {
    const int64_t t = now_ns();
    g.prof[k] += t - t_phase;
    t_phase = t;
  };
  auto copy_in = [&](int64_t j) {
    const int64_t off = j * chunk;
    auto& b = bounds[j % 3];
    char* mine = g.slot(in_buf(j), g.rank);
    for (int r = 0; r < n; ++r) {
      if (r == g.rank || b[r + 1] == b[r]) continue;
      if (nt_copy)
        stream_copy(mine + b[r] * es, xp + (off + b[r]) * es, size_t(b[r + 1] - b[r]) * es);
      else
        memcpy(mine + b[r] * es, xp + (off + b[r]) * es, size_t(b[r + 1] - b[r]) * es);
    }
  };
  for (int64_t j = 0; j <= nchunks + 1; ++j) {
    if (j < nchunks) {  // copy chunk j in (chunk 0 of a registered input: only if the ranks fall back, below)
      const int64_t off = j * chunk, len = std::min(chunk, numel - off);
      slice_bounds(len, n, es, bounds[j % 3]);
      if (j > 0 || !reg_in) copy_in(j);
    }
    lap(0);
    if (j >= 1 && j <= nchunks) {  // reduce my slice of chunk j-1 (its inputs are in since barrier j-1)
      const int64_t c = j - 1, off = c * chunk;
      auto& b = bounds[c % 3];
      const int64_t s0 = b[g.rank], s1 = b[g.rank + 1];
      if (s1 > s0) {
        for (int r = 0; r < n; ++r)
          srcs[r] = (r == g.rank ? xp + off * es : g.slot(in_buf(c), r)) + s0 * es;
        const size_t at = size_t(off + s0) * es;
        Dests d;
        d.add(op_ + at, stream);
        for (int q = 0; q < n; ++q)
          if (q != g.rank && peer_shared[q]) d.add(g.out_region(q) + (peer_shared[q] - 1) + at, stream);
        if (slot_results) d.add(const_cast<char*>(srcs[(g.rank + 1) % n]), false);
        reduce_to(dt, srcs.data(), n, s1 - s0, d, rop);
      }
    }
    lap(1);
    if (j >= 2 && !mine_shared) {  // copy chunk j-2's other slices out (reduced before barrier j-1)
      const int64_t c = j - 2, off = c * chunk;
      auto& b = bounds[c % 3];
      for (int r = 0; r < n; ++r) {
        if (r == g.rank || b[r + 1] == b[r]) continue;
        copy_to(op_ + (off + b[r]) * es, g.slot(in_buf(c), (r + 1) % n) + b[r] * es, size_t(b[r + 1] - b[r]) * es,
                stream);
      }
    }
    lap(2);
    if (j <= nchunks) {
      barrier(g, op, start);
      if (j == 0) {
        use.check(op, x);
        bool any_reg = reg_in, all_reg = reg_in;
        for (int q = 0; q < n; ++q) {
          if (q == g.rank) continue;
          peer_shared[q] = g.hdr->counters[q].shared[use.half].load(std::memory_order_relaxed);
          slot_results = slot_results || !peer_shared[q];
          const uint64_t w = g.hdr->counters[q].reg[use.half].load(std::memory_order_relaxed);
          any_reg = any_reg || w != 0;
          all_reg = all_reg && w == reg_word;
        }
        if (all_reg && mine_shared && !slot_results) {  // every input registered at one offset, outputs shared
          lap(3);
          const size_t off_bytes = size_t(reg_word - 1);
          std::vector<int64_t> b;
          slice_bounds(numel, n, es, b);
          const int64_t s0 = b[g.rank], s1 = b[g.rank + 1];
          if (s1 > s0) {
            for (int r = 0; r < n; ++r) srcs[r] = g.in_region(r) + off_bytes + size_t(s0) * es;
            const size_t at = size_t(s0) * es;
            Dests d;
            d.add(op_ + at, stream);
            for (int q = 0; q < n; ++q)
              if (q != g.rank) d.add(g.out_region(q) + (peer_shared[q] - 1) + at, stream);
            reduce_to(dt, srcs.data(), n, s1 - s0, d, rop);
          }
          lap(1);
          barrier(g, op, start);  // peers done reading this rank's input and writing its output
          lap(3);
          g.prof[4] += now_ns() - t_call;
          g.prof[5] += 1;
          g.prof[6] += 1;
          return out;
        }
        if (any_reg) {  // fall back to the pipeline on every rank: chunk 0's copy-in, then one more barrier
          if (reg_in) copy_in(0);
          lap(0);
          barrier(g, op, start);
        }
      }
    }
    lap(3);
  }
  const int64_t took = now_ns() - t_call;
  g.prof[4] += took;
  g.prof[5] += 1;
  if (probing) {  // (a call that read registered inputs in place returned above: no copy-in to time)
    g.copyin_ns_per_mib[nt_copy] += int64_t(double(took) * double(1 << 20) / double(bytes));
    g.copyin_n[nt_copy] += 1;
    if (cycle == kCopyinProbe - 1 && g.copyin_n[0] > 0 && g.copyin_n[1] > 0)
      g.copyin_nt = g.copyin_ns_per_mib[1] * g.copyin_n[0] < g.copyin_ns_per_mib[0] * g.copyin_n[1];
  }
  return out;
}

static at::Tensor all_gather_shape_out(const at::Tensor& x, int n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  if (shape.empty()) shape.push_back(1);
  shape[0] *= n;
  return at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
}

static at::Tensor all_gather_cpu(const at::Tensor& input, int64_t group_size, c10::string_view group_name,
                                 at::Tensor given = at::Tensor()) {
  const char* op = "all_gather";
  check_dtype(input, op, false);
  auto gp = find_group(std::string(group_name));
  Group& g = *gp;
  TORCH_CHECK_VALUE(group_size == g.size, "adaptdist shm: all_gather was given group_size ", group_size, " but ",
                    group_desc(g), " has ", g.size, " ranks");
  std::lock_guard<std::mutex> lock(g.mu);
  check_abort(g, op);
  at::Tensor x = input.contiguous();
  at::Tensor out = given.defined() ? given : all_gather_shape_out(x, g.size);
  const int64_t numel = x.numel();
  if (numel == 0) return out;
  const size_t es = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op_ = static_cast<char*>(out.data_ptr());
  const int n = g.size;
  const double start = now_s();
  const uint64_t sig = signature(2, x.scalar_type(), numel, 0);
  const int64_t chunk = int64_t(g.slot_bytes / es);
  for (int64_t off = 0; off < numel; off += chunk) {
    const int64_t len = std::min(chunk, numel - off);
    UseGuard use(g, sig);
    memcpy(g.slot(use.half, g.rank), xp + off * es, size_t(len) * es);
    memcpy(op_ + (g.rank * numel + off) * es, xp + off * es, size_t(len) * es);
    if (n > 1) barrier(g, op, start);
    if (off == 0) use.check(op, x);
    for (int r = 0; r < n; ++r) {
      if (r == g.rank) continue;
      memcpy(op_ + (r * numel + off) * es, g.slot(use.half, r), size_t(len) * es);
    }
  }
  return out;
}

static at::Tensor reduce_scatter_shape_out(const at::Tensor& x, int n) {
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape[0] /= n;
  return at::empty(shape, x.options().memory_format(at::MemoryFormat::Contiguous));
}

static at::Tensor reduce_scatter_cpu(const at::Tensor& input, c10::string_view reduce_op, int64_t group_size,
                                     c10::string_view group_name, at::Tensor given = at::Tensor()) {
  const char* op = "reduce_scatter";
  check_dtype(input, op, true);
  RedOp rop = parse_op(std::string(reduce_op));
  auto gp = find_group(std::string(group_name));
  Group& g = *gp;
  TORCH_CHECK_VALUE(group_size == g.size, "adaptdist shm: reduce_scatter was given group_size ", group_size, " but ",
                    group_desc(g), " has ", g.size, " ranks");
  TORCH_CHECK_VALUE(input.dim() >= 1 && input.size(0) % g.size == 0, "adaptdist shm: reduce_scatter needs dim 0 (",
                    input.dim() >= 1 ? input.size(0) : 0, " in shape ", input.sizes(), ") divisible by the ",
                    g.size, " ranks of ", group_desc(g));
  std::lock_guard<std::mutex> lock(g.mu);
  check_abort(g, op);
  at::Tensor x = input.contiguous();
  at::Tensor out = given.defined() ? given : reduce_scatter_shape_out(x, g.size);
  const int64_t M = out.numel();  // elements per rank
  if (M == 0) return out;
  const size_t es = x.element_size();
  const at::ScalarType dt = x.scalar_type();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op_ = static_cast<char*>(out.data_ptr());
  const int n = g.size;
  const double start = now_s();
  const uint64_t sig = signature(3, dt, M, int64_t(rop));
  std::vector<const char*> srcs(n);
  const int64_t unit = std::max<int64_t>(1, int64_t(kAlign / es));
  const int64_t seg = std::max<int64_t>(unit, (int64_t(g.slot_bytes / es) / n) / unit * unit);
  for (int64_t off = 0; off < M; off += seg) {
    const int64_t len = std::min(seg, M - off);
    UseGuard use(g, sig);
    char* mine = g.slot(use.half, g.rank);
    for (int r = 0; r < n; ++r) {
      if (r == g.rank) continue;
      memcpy(mine + r * seg * es, xp + (r * M + off) * es, size_t(len) * es);
    }
    if (n > 1) barrier(g, op, start);
    if (off == 0) use.check(op, x);
    for (int q = 0; q < n; ++q)
      srcs[q] = q == g.rank ? xp + (g.rank * M + off) * es : g.slot(use.half, q) + g.rank * seg * es;
    reduce_dispatch(dt, srcs.data(), n, len, op_ + off * es, rop);
  }
  return out;
}

static at::Tensor all_to_all_cpu(const at::Tensor& input, c10::SymIntArrayRef output_split_sizes,
                                 c10::SymIntArrayRef input_split_sizes, c10::string_view group_name) {
  const char* op = "all_to_all";
  check_dtype(input, op, false);
  auto gp = find_group(std::string(group_name));
  Group& g = *gp;
  const int n = g.size;
  TORCH_CHECK_VALUE(input.dim() >= 1 && input.size(0) % n == 0, "adaptdist shm: all_to_all needs dim 0 (",
                    input.dim() >= 1 ? input.size(0) : 0, " in shape ", input.sizes(), ") divisible by the ", n,
                    " ranks of ", group_desc(g));
  const int64_t rows = input.size(0) / n;
  for (auto splits : {output_split_sizes, input_split_sizes}) {
    if (splits.empty()) continue;
    bool equal = int64_t(splits.size()) == n;
    for (const auto& s : splits) equal = equal && s.guard_int(__FILE__, __LINE__) == rows;
    TORCH_CHECK_VALUE(equal, "adaptdist shm: all_to_all supports equal splits only (", rows,
                      " rows to and from each of the ", n, " ranks; pass [] or [", rows, "] * ", n,
                      "); use the gloo all_to_all_single for uneven splits");
  }
  std::lock_guard<std::mutex> lock(g.mu);
  check_abort(g, op);
  at::Tensor x = input.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t M = x.numel() / n;  // elements per destination
  if (M == 0) return out;
  const size_t es = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op_ = static_cast<char*>(out.data_ptr());
  const double start = now_s();
  const uint64_t sig = signature(4, x.scalar_type(), M, 0);
  const int64_t unit = std::max<int64_t>(1, int64_t(kAlign / es));
  const int64_t seg = std::max<int64_t>(unit, (int64_t(g.slot_bytes / es) / n) / unit * unit);
  for (int64_t off = 0; off < M; off += seg) {
    const int64_t len = std::min(seg, M - off);
    UseGuard use(g, sig);
    char* mine = g.slot(use.half, g.rank);
    for (int r = 0; r < n; ++r) {
      if (r == g.rank) continue;
      memcpy(mine + r * seg * es, xp + (r * M + off) * es, size_t(len) * es);
    }
    memcpy(op_ + (g.rank * M + off) * es, xp + (g.rank * M + off) * es, size_t(len) * es);
    if (n > 1) barrier(g, op, start);
    if (off == 0) use.check(op, x);
    for (int q = 0; q < n; ++q) {
      if (q == g.rank) continue;
      memcpy(op_ + (q * M + off) * es, g.slot(use.half, q) + g.rank * seg * es, size_t(len) * es);
    }
  }
  return out;
}

static at::Tensor broadcast_cpu(const at::Tensor& input, int64_t src, c10::string_view group_name) {
  const char* op = "broadcast";
  check_dtype(input, op, false);
  auto gp = find_group(std::string(group_name));
  Group& g = *gp;
  TORCH_CHECK_VALUE(src >= 0 && src < g.size, "adaptdist shm: broadcast src ", src, " is not a group rank of ",
                    group_desc(g), " (0..", g.size - 1, ")");
  std::lock_guard<std::mutex> lock(g.mu);
  check_abort(g, op);
  at::Tensor x = input.contiguous();
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t numel = x.numel();
  if (numel == 0) return out;
  const size_t es = x.element_size();
  const char* xp = static_cast<const char*>(x.data_ptr());
  char* op_ = static_cast<char*>(out.data_ptr());
  const double start = now_s();
  const uint64_t sig = signature(5, x.scalar_type(), numel, src);
  // The source may fill the whole half (every rank's slot): broadcast moves one payload only.
  const int64_t chunk = int64_t(g.slot_bytes * g.size / es);
  for (int64_t off = 0; off < numel; off += chunk) {
    const int64_t len = std::min(chunk, numel - off);
    UseGuard use(g, sig);
    if (g.rank == src) {
      memcpy(g.half_base(use.half), xp + off * es, size_t(len) * es);
      memcpy(op_ + off * es, xp + off * es, size_t(len) * es);
    }
    if (g.size > 1) barrier(g, op, start);
    if (off == 0) use.check(op, x);
    if (g.rank != src) memcpy(op_ + off * es, g.half_base(use.half), size_t(len) * es);
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Meta kernels (shapes only: FakeTensor, torch.compile, the planner's shape propagation)

static at::Tensor all_reduce_meta(const at::Tensor& input, c10::string_view, c10::string_view) {
  return at::empty_like(input, at::MemoryFormat::Contiguous);
}

static at::Tensor all_gather_meta(const at::Tensor& input, int64_t group_size, c10::string_view) {
  auto shape = input.sym_sizes().vec();
  if (shape.empty()) shape.push_back(c10::SymInt(1));
  shape[0] = shape[0] * group_size;
  return at::empty_symint(shape, input.options().memory_format(at::MemoryFormat::Contiguous));
}

static at::Tensor reduce_scatter_meta(const at::Tensor& input, c10::string_view, int64_t group_size,
                                      c10::string_view) {
  auto shape = input.sym_sizes().vec();
  TORCH_CHECK_VALUE(!shape.empty(), "adaptdist shm: reduce_scatter needs a tensor with dim 0");
  shape[0] = shape[0] / group_size;
  return at::empty_symint(shape, input.options().memory_format(at::MemoryFormat::Contiguous));
}

static at::Tensor all_to_all_meta(const at::Tensor& input, c10::SymIntArrayRef, c10::SymIntArrayRef,
                                  c10::string_view) {
  return at::empty_like(input, at::MemoryFormat::Contiguous);
}

static at::Tensor broadcast_meta(const at::Tensor& input, int64_t, c10::string_view) {
  return at::empty_like(input, at::MemoryFormat::Contiguous);
}

static at::Tensor wait_meta(const at::Tensor& input) { return at::empty_like(input); }

static at::Tensor flatten_all_reduce_meta(at::TensorList inputs, int64_t, c10::string_view, c10::string_view) {
  TORCH_CHECK_VALUE(!inputs.empty(), "adaptdist shm: shm_flatten_all_reduce_start needs at least one tensor");
  c10::SymInt total = 0;
  for (const auto& t : inputs) total = total + t.sym_numel();
  return at::empty_symint({total}, inputs[0].options());
}

// ---------------------------------------------------------------------------------------------
// group management (called by adaptdist/kernels/shm.py)

static void group_attach(c10::string_view group_name, c10::string_view segment, int64_t group_rank, int64_t group_size,
                         int64_t global_rank, int64_t slot_bytes, double timeout_s, int64_t spin_ns, bool create) {
  const std::string name(group_name), seg(segment);
  TORCH_CHECK_VALUE(group_size >= 1 && group_size <= kMaxRanks, "adaptdist shm: group '", name, "' has ", group_size,
                    " ranks; shared-memory groups take 1..", kMaxRanks);
  TORCH_CHECK_VALUE(group_rank >= 0 && group_rank < group_size, "adaptdist shm: group rank ", group_rank,
                    " is outside 0..", group_size - 1);
  TORCH_CHECK_VALUE(slot_bytes >= 4096 && slot_bytes % 4096 == 0, "adaptdist shm: slot_bytes ", slot_bytes,
                    " must be a positive multiple of 4096");
  {
    auto& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mu);
    TORCH_CHECK_VALUE(reg.groups.find(name) == reg.groups.end(), "adaptdist shm: a shared-memory group named '", name,
                      "' already exists on this process; destroy it first or choose another name");
  }
  const size_t data_offset = (sizeof(Header) + 4095) / 4096 * 4096;
  const size_t outs_offset = data_offset + kBuffers * size_t(group_size) * size_t(slot_bytes);
  const size_t ins_offset = outs_offset + size_t(group_size) * kSharedOutBytes;
  const size_t map_bytes = ins_offset + size_t(group_size) * kSharedInBytes;
  int fd = -1;
  bool no_fallocate = false;
  if (create) {
    fd = shm_open(seg.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
    TORCH_CHECK(fd >= 0, "adaptdist shm: cannot create shared-memory segment /dev/shm", seg, ": ", strerror(errno));
    if (ftruncate(fd, off_t(map_bytes)) != 0) {
      int e = errno;
      close(fd);
      shm_unlink(seg.c_str());
      TORCH_CHECK(false, "adaptdist shm: cannot size /dev/shm", seg, " to ", map_bytes, " bytes: ", strerror(e),
                  " (is /dev/shm large enough? `df -h /dev/shm`)");
    }
    // What every collective touches (the header, the slots), reserved now: a full /dev/shm is this error, not a
    // SIGBUS at some later first touch. The regions are reserved as used (reserve_region).
    int e = 0;
    while (fallocate(fd, 0, 0, off_t(outs_offset)) != 0) {
      e = errno;
      if (e != EINTR) break;
      e = 0;
    }
    if (fallocate_unsupported(e)) no_fallocate = true;  // (no reservations there: pages come as touched)
    if (e != 0 && !fallocate_unsupported(e)) {
      const std::string space = shm_space_desc();  // before the unlink gives the partial reservation back
      close(fd);
      shm_unlink(seg.c_str());
      TORCH_CHECK(false, "adaptdist shm: cannot create shared-memory group '", name, "' (", group_size,
                  " ranks, slot ", slot_bytes, " bytes): its header and slots need ", outs_offset, " bytes of ",
                  space, " and reserving them failed: ", strerror(e), " [needed_bytes=", outs_offset, "]",
                  capacity_advice(), kCapacityTag);
    }
  } else {
    fd = shm_open(seg.c_str(), O_RDWR, 0600);
    TORCH_CHECK(fd >= 0, "adaptdist shm: cannot open shared-memory segment /dev/shm", seg, " of group '", name,
                "': ", strerror(errno), " (its creator, group rank 0, may have died or not be on this host)");
    struct stat st;
    const bool size_ok = fstat(fd, &st) == 0 && size_t(st.st_size) == map_bytes;
    if (!size_ok) close(fd);
    TORCH_CHECK(size_ok, "adaptdist shm: /dev/shm", seg,
                " has the wrong size for group '", name, "' (", group_size, " ranks, slot ", slot_bytes, " bytes)");
  }
  void* p = mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  int e = errno;
  if (p == MAP_FAILED) {
    close(fd);
    if (create) shm_unlink(seg.c_str());
    TORCH_CHECK(false, "adaptdist shm: cannot map /dev/shm", seg, ": ", strerror(e));
  }
  auto g = std::make_shared<Group>();
  g->name = name;
  g->segment = seg;
  g->rank = int(group_rank);
  g->size = int(group_size);
  g->global_rank = int(global_rank);
  g->timeout_s = timeout_s;
  g->spin_ns = spin_ns;
  g->slot_bytes = size_t(slot_bytes);
  g->map_bytes = map_bytes;
  g->fd = fd;
  g->no_fallocate = no_fallocate;
  g->outs_offset = outs_offset;
  g->ins_offset = ins_offset;
  // For tuning measurements (benchmarks/RESULTS.md): every rank of a group must set the same value.
  if (const char* cb = getenv("ADAPTDIST_SHM_CHUNK_BYTES")) {
    const long long v = atoll(cb);
    if (v >= 4096 && v % 4096 == 0) g->chunk_bytes = size_t(v);
  }
  g->map = std::make_shared<Mapping>();
  g->map->p = p;
  g->map->bytes = map_bytes;
  g->creator = create;
  g->hdr = static_cast<Header*>(p);
  g->data = static_cast<char*>(p) + data_offset;
  g->outs = static_cast<char*>(p) + outs_offset;
  g->ins = static_cast<char*>(p) + ins_offset;
  g->shared_output = std::make_shared<SharedOutput>();
  g->shared_output->map = g->map;
  g->shared_output->data = g->out_region(int(group_rank));
  Header* h = g->hdr;
  if (create) {
    // ftruncate zero-fills: counters, flags and abort state start at 0.
    h->group_size = uint32_t(group_size);
    h->slot_bytes = uint64_t(slot_bytes);
    h->data_offset = data_offset;
    std::atomic_thread_fence(std::memory_order_seq_cst);
    reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->store(kMagic);
  } else {
    TORCH_CHECK(reinterpret_cast<std::atomic<uint64_t>*>(&h->magic)->load() == kMagic &&
                    h->group_size == uint32_t(group_size) && h->slot_bytes == uint64_t(slot_bytes),
                "adaptdist shm: /dev/shm", seg, " is not a segment of group '", name, "' with ", group_size,
                " ranks (stale or foreign)");
  }
  h->ranks[group_rank].pid.store(getpid());
  h->ranks[group_rank].global_rank.store(int32_t(global_rank));
  h->ranks[group_rank].attached.store(1);
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.groups[name] = g;
}

// Wait until every rank attached (named ones that did not, on timeout); the creator then unlinks the
// name, so the memory is freed by the kernel once the last rank exits, even after a crash.
static void group_wait_attached(c10::string_view group_name) {
  auto gp = find_group(std::string(group_name));
  Group& g = *gp;
  const double start = now_s();
  double sleep_s = 1e-4;
  while (true) {
    int missing = -1;
    for (int r = 0; r < g.size; ++r)
      if (g.hdr->ranks[r].attached.load() == 0) {
        missing = r;
        break;
      }
    if (missing < 0) break;
    check_abort(g, "attach");
    if (now_s() - start > g.timeout_s) {
      std::ostringstream os;
      os << "adaptdist shm: group rank " << missing << " of " << group_desc(g) << " did not attach to /dev/shm"
         << g.segment << " within " << g.timeout_s << " s";
      C10_THROW_ERROR(DistBackendError, os.str());
    }
    usleep(useconds_t(sleep_s * 1e6));
    sleep_s = std::min(sleep_s * 2, 0.01);
  }
  if (g.creator && !g.unlinked) {
    shm_unlink(g.segment.c_str());
    g.unlinked = true;
  }
}

static void group_destroy(c10::string_view group_name) {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  reg.groups.erase(std::string(group_name));  // unmaps (and unlinks, if still linked) once no op holds it
}

static std::vector<std::string> group_names_impl() {
  auto& reg = registry();
  std::lock_guard<std::mutex> lock(reg.mu);
  std::vector<std::string> out;
  for (auto& kv : reg.groups) out.push_back(kv.first);
  return out;
}

// Pids of the group's ranks (group-rank order): for diagnostics and tests.
static std::vector<int64_t> group_pids(c10::string_view group_name) {
  auto gp = find_group(std::string(group_name));
  std::vector<int64_t> out;
  for (int r = 0; r < gp->size; ++r) out.push_back(gp->hdr->ranks[r].pid.load());
  return out;
}

// Phase times (s) of the chunked all_reduce since the last call: copy-in, reduce, copy-out, barrier
// waits, whole calls, the number of calls, and how many of them read registered inputs in place (no copy-in);
// resets them. For benchmarks/profile_shm.py and the tests.
static std::vector<double> group_profile(c10::string_view group_name) {
  auto gp = find_group(std::string(group_name));
  std::lock_guard<std::mutex> lock(gp->mu);
  std::vector<double> out;
  for (int k = 0; k < 5; ++k) out.push_back(double(gp->prof[k]) * 1e-9);
  out.push_back(double(gp->prof[5]));
  out.push_back(double(gp->prof[6]));
  std::fill(std::begin(gp->prof), std::end(gp->prof), 0);
  return out;
}

// Run the group's collectives on a thread of its own (on) or on the calling thread (off); see CommThread.
static void group_set_comm_thread(c10::string_view group_name, bool on) {
  auto gp = find_group(std::string(group_name));
  std::unique_ptr<CommThread> old;
  {
    std::lock_guard<std::mutex> lock(gp->mu);
    if (on && !gp->comm) gp->comm = std::make_unique<CommThread>();
    if (!on) old = std::move(gp->comm);
  }
  old.reset();  // outside the group's lock: the thread first runs the jobs queued (they take that lock)
}

// Blocking collectives whose input has at most this many bytes run on the calling thread when the comm thread
// is idle: such a call is one barrier (all_reduce's one-barrier path is <= 32 KiB), and handing it over costs two
// thread wake-ups (the comm thread's, then the caller's), which measured 100+ us on this 2-core host against a
// 4 KiB all_reduce's 5-20 us (benchmarks/RESULTS.md, 2026-12-04). Larger and started collectives still go to it.
constexpr size_t kInlineBytes = size_t(32) << 10;

// A CPU kernel's entry: f() on the group's comm thread when it has one, else here; its exception rethrown here.
// input_bytes: the collective's input size (small ones may run here, see kInlineBytes).
template <class F>
static at::Tensor on_comm_thread(c10::string_view group_name, F f, size_t input_bytes = SIZE_MAX) {
  std::shared_ptr<Group> gp;
  {
    auto& reg = registry();
    std::lock_guard<std::mutex> lock(reg.mu);
    auto it = reg.groups.find(std::string(group_name));
    if (it != reg.groups.end()) gp = it->second;
  }
  CommThread* t = gp ? gp->comm.get() : nullptr;
  if (t == nullptr) return f();  // also: no such group, which f reports
  if (input_bytes <= kInlineBytes && t->idle()) return f();
  at::Tensor out;
  std::exception_ptr err;
  t->run([&] {
    try {
      out = f();
    } catch (...) {
      err = std::current_exception();
    }
  });
  if (err) std::rethrow_exception(err);
  return out;
}

static size_t nbytes(const at::Tensor& t) { return size_t(t.numel()) * t.element_size(); }

static at::Tensor all_reduce_entry(const at::Tensor& input, c10::string_view reduce_op, c10::string_view group_name) {
  return on_comm_thread(group_name, [&] { return all_reduce_cpu(input, reduce_op, group_name); }, nbytes(input));
}
static at::Tensor all_gather_entry(const at::Tensor& input, int64_t group_size, c10::string_view group_name) {
  return on_comm_thread(group_name, [&] { return all_gather_cpu(input, group_size, group_name); }, nbytes(input));
}
static at::Tensor reduce_scatter_entry(const at::Tensor& input, c10::string_view reduce_op, int64_t group_size,
                                       c10::string_view group_name) {
  return on_comm_thread(group_name, [&] { return reduce_scatter_cpu(input, reduce_op, group_size, group_name); },
                        nbytes(input));
}
static at::Tensor all_to_all_entry(const at::Tensor& input, c10::SymIntArrayRef output_split_sizes,
                                   c10::SymIntArrayRef input_split_sizes, c10::string_view group_name) {
  return on_comm_thread(group_name,
                        [&] { return all_to_all_cpu(input, output_split_sizes, input_split_sizes, group_name); },
                        nbytes(input));
}
static at::Tensor broadcast_entry(const at::Tensor& input, int64_t src, c10::string_view group_name) {
  return on_comm_thread(group_name, [&] { return broadcast_cpu(input, src, group_name); }, nbytes(input));
}

// Started collectives: output tensor -> its Pending, until shm_wait (or, on success, until the job ends: a wait
// that finds no entry has nothing to wait for).
struct PendingRegistry {
  std::mutex mu;
  std::map<const void*, std::shared_ptr<Pending>> by_output;
};

static PendingRegistry& pending_registry() {
  static PendingRegistry* r = new PendingRegistry();  // leaked on purpose, as the groups' registry
  return *r;
}

// A *_start op: on a group with a comm thread, `out` (allocated here, on the caller's thread) is returned at
// once and filled by `run(out)` on that thread, after the collectives queued before it; shm_wait(out) waits.
// Without a comm thread the collective runs here to completion (shm_wait then returns at once). Arguments
// are checked by the caller before (bad arguments raise here, not at the wait).
template <class Alloc, class Run>
static at::Tensor start_on_comm_thread(c10::string_view group_name, Alloc alloc, Run run) {
  auto gp = find_group(std::string(group_name));
  CommThread* t = gp->comm.get();
  if (t == nullptr) return run(at::Tensor());
  check_abort(*gp, "start");
  at::Tensor out = alloc(*gp);
  auto p = std::make_shared<Pending>();
  const void* key = out.unsafeGetTensorImpl();
  {
    auto& reg = pending_registry();
    std::lock_guard<std::mutex> l(reg.mu);
    reg.by_output[key] = p;
  }
  t->submit([p, out, key, run]() mutable {  // not the group: the op finds it by name (and fails if it is gone)
    std::exception_ptr err;
    try {
      run(out);
    } catch (...) {
      err = std::current_exception();
    }
    if (!err) {  // nothing to report: the wait need not find it (and a reused address cannot find it stale)
      auto& reg = pending_registry();
      std::lock_guard<std::mutex> l(reg.mu);
      auto it = reg.by_output.find(key);
      if (it != reg.by_output.end() && it->second == p) reg.by_output.erase(it);
    }
    p->finish(err);
  });
  return out;
}

static at::Tensor all_reduce_start(const at::Tensor& input, c10::string_view reduce_op, c10::string_view group_name) {
  check_dtype(input, "all_reduce", true);
  parse_op(std::string(reduce_op));
  at::Tensor x = input.contiguous();  // the job keeps it alive until it ran
  std::string rop(reduce_op), name(group_name);
  return start_on_comm_thread(
      group_name, [&](Group& g) { return x.numel() == 0 ? at::empty_like(x) : reusable_output(g, x); },
      [x, rop, name](at::Tensor out) { return all_reduce_cpu(x, rop, name, out); });
}

// A tensor of `numel` elements of `dtype` on this rank's registered input region at `offset_bytes` (see
// kSharedInBytes): an all_reduce of it (or of a contiguous part of it) at the same offset and size on every rank
// reads it in place. The tensor keeps the segment mapped after its group is destroyed.
static at::Tensor input_region_tensor(Group& g, int64_t offset_bytes, int64_t numel, at::ScalarType dtype) {
  const int64_t es = int64_t(c10::elementSize(dtype));
  TORCH_CHECK_VALUE(numel >= 0 && offset_bytes >= 0 && offset_bytes % 64 == 0, "adaptdist shm: input buffer of ",
                    group_desc(g), ": offset_bytes ", offset_bytes, " must be a non-negative multiple of 64 and numel ",
                    numel, " non-negative");
  TORCH_CHECK_VALUE(uint64_t(offset_bytes) <= kSharedInBytes &&  // (no overflow of numel * es)
                        uint64_t(numel) <= (kSharedInBytes - uint64_t(offset_bytes)) / uint64_t(es),
                    "adaptdist shm: input buffer of ", group_desc(g), ": ", numel, " elements of ", dtype, " (",
                    numel * es, " bytes) at offset ", offset_bytes, " exceed the rank's input region of ",
                    kSharedInBytes, " bytes");
  const int err = reserve_region(g, false, size_t(offset_bytes), size_t(offset_bytes) + size_t(numel * es));
  TORCH_CHECK(err == 0, "adaptdist shm: input buffer of ", group_desc(g), ": cannot reserve ", numel * es,
              " bytes at offset ", offset_bytes, " of its registered input region in ", shm_space_desc(), ": ",
              strerror(err), capacity_advice(), "; or pass a plain tensor to the all_reduce (it then copies it in) ",
              kCapacityTag);
  std::shared_ptr<Mapping> keep = g.map;
  return at::for_blob(g.in_region(g.rank) + offset_bytes, {numel})
      .deleter([keep](void*) {})
      .options(at::TensorOptions().dtype(dtype))
      .make_tensor();
}

static at::Tensor group_input_buffer(c10::string_view group_name, int64_t offset_bytes, int64_t numel,
                                     at::ScalarType dtype) {
  auto gp = find_group(std::string(group_name));
  return input_region_tensor(*gp, offset_bytes, numel, dtype);
}

static int64_t group_input_region_bytes(c10::string_view group_name) {
  find_group(std::string(group_name));
  return int64_t(kSharedInBytes);
}

// A gradient bucket's flatten and all_reduce in one op: the inputs (one dtype), flattened and concatenated in
// order, are copied straight into this rank's registered input region at input_offset_bytes (this copy replaces
// torch.cat's), and the all_reduce of that 1-d tensor is started there (shm_all_reduce_start; wait with shm_wait).
// Every rank must pass the same offset. Where the bucket does not fit the region, /dev/shm has no space left for
// its range, or the group has one rank, it is torch.cat + shm_all_reduce_start (bitwise the same result). The caller
// must not start another collective on the same bytes of the region before this one's shm_wait returned (the
// lowering gives each bucket of a step its own offset).
static at::Tensor flatten_all_reduce_start(at::TensorList inputs, int64_t input_offset_bytes,
                                           c10::string_view reduce_op, c10::string_view group_name) {
  TORCH_CHECK_VALUE(!inputs.empty(), "adaptdist shm: shm_flatten_all_reduce_start needs at least one tensor");
  const at::ScalarType dt = inputs[0].scalar_type();
  int64_t total = 0;
  for (const auto& t : inputs) {
    TORCH_CHECK_TYPE(t.scalar_type() == dt, "adaptdist shm: shm_flatten_all_reduce_start takes tensors of one dtype, "
                     "got ", dt, " and ", t.scalar_type());
    check_dtype(t, "all_reduce", true);
    total += t.numel();
  }
  parse_op(std::string(reduce_op));
  auto gp = find_group(std::string(group_name));
  const uint64_t bytes = uint64_t(total) * c10::elementSize(dt);
  if (gp->size > 1 && input_offset_bytes >= 0 && input_offset_bytes % 64 == 0 &&
      uint64_t(input_offset_bytes) + bytes <= kSharedInBytes &&
      reserve_region(*gp, false, size_t(input_offset_bytes), size_t(input_offset_bytes + bytes)) == 0) {
    at::Tensor flat = input_region_tensor(*gp, input_offset_bytes, total, dt);
    char* base = static_cast<char*>(flat.data_ptr());
    const size_t es = c10::elementSize(dt);
    int64_t pos = 0;
    for (const auto& t : inputs) {
      const int64_t k = t.numel();
      // a contiguous part is one memcpy: copy_ through the dispatcher cost ~3 us a part (a 1 MiB bucket of 64
      // parts took 1.1-1.4x cat + all_reduce's time)
      if (k > 0 && t.is_contiguous())
        memcpy(base + size_t(pos) * es, t.data_ptr(), size_t(k) * es);
      else if (k > 0)
        flat.narrow(0, pos, k).view(t.sizes()).copy_(t);
      pos += k;
    }
    return all_reduce_start(flat, reduce_op, group_name);
  }
  std::vector<at::Tensor> flats;
  for (const auto& t : inputs) flats.push_back(t.reshape({-1}));
  return all_reduce_start(at::cat(flats), reduce_op, group_name);
}

static at::Tensor all_gather_start(const at::Tensor& input, int64_t group_size, c10::string_view group_name) {
  check_dtype(input, "all_gather", false);
  at::Tensor x = input.contiguous();
  std::string name(group_name);
  return start_on_comm_thread(
      group_name,
      [&](Group& g) {
        TORCH_CHECK_VALUE(group_size == g.size, "adaptdist shm: all_gather was given group_size ", group_size,
                          " but ", group_desc(g), " has ", g.size, " ranks");
        return all_gather_shape_out(x, g.size);
      },
      [x, group_size, name](at::Tensor out) { return all_gather_cpu(x, group_size, name, out); });
}

static at::Tensor reduce_scatter_start(const at::Tensor& input, c10::string_view reduce_op, int64_t group_size,
                                       c10::string_view group_name) {
  check_dtype(input, "reduce_scatter", true);
  parse_op(std::string(reduce_op));
  at::Tensor x = input.contiguous();
  std::string rop(reduce_op), name(group_name);
  return start_on_comm_thread(
      group_name,
      [&](Group& g) {
        TORCH_CHECK_VALUE(group_size == g.size, "adaptdist shm: reduce_scatter was given group_size ", group_size,
                          " but ", group_desc(g), " has ", g.size, " ranks");
        TORCH_CHECK_VALUE(x.dim() >= 1 && x.size(0) % g.size == 0, "adaptdist shm: reduce_scatter needs dim 0 (",
                          x.dim() >= 1 ? x.size(0) : 0, " in shape ", x.sizes(), ") divisible by the ", g.size,
                          " ranks of ", group_desc(g));
        return reduce_scatter_shape_out(x, g.size);
      },
      [x, rop, group_size, name](at::Tensor out) { return reduce_scatter_cpu(x, rop, group_size, name, out); });
}

// Wait for the collective that produced `tensor` (a *_start op's output) and return it; any other tensor (one
// whose collective already completed, or ran synchronously) is returned at once. The collective's error, if it
// failed, is raised here.
static at::Tensor shm_wait(const at::Tensor& tensor) {
  std::shared_ptr<Pending> p;
  {
    auto& reg = pending_registry();
    std::lock_guard<std::mutex> l(reg.mu);
    auto it = reg.by_output.find(tensor.unsafeGetTensorImpl());
    if (it == reg.by_output.end()) return tensor;
    p = it->second;
  }
  std::exception_ptr err = p->wait();
  {
    auto& reg = pending_registry();
    std::lock_guard<std::mutex> l(reg.mu);
    auto it = reg.by_output.find(tensor.unsafeGetTensorImpl());
    if (it != reg.by_output.end() && it->second == p) reg.by_output.erase(it);
  }
  if (err) std::rethrow_exception(err);
  return tensor;
}

static int64_t abi_version() { return 4; }  // adaptdist/kernels/__init__.py ABI_VERSION

}  // namespace adaptdist_shm

TORCH_LIBRARY(adaptdist, m) {
  // Functional (out-of-place) collectives; signatures mirror torch.ops._c10d_functional's, so a graph's
  // functional collective becomes a shared-memory one by changing the op only. They complete on return
  // (no wait_tensor needed).
  m.def("shm_all_reduce(Tensor input, str reduce_op, str group_name) -> Tensor");
  m.def("shm_all_gather_into_tensor(Tensor input, int group_size, str group_name) -> Tensor");
  m.def("shm_reduce_scatter_tensor(Tensor input, str reduce_op, int group_size, str group_name) -> Tensor");
  m.def("shm_all_to_all_single(Tensor input, SymInt[] output_split_sizes, SymInt[] input_split_sizes, "
        "str group_name) -> Tensor");
  m.def("shm_broadcast(Tensor input, int src, str group_name) -> Tensor");
  // Started collectives: the same signatures; the output is complete only after shm_wait(output) (as
  // _c10d_functional's collectives and wait_tensor). With the group's comm thread off they complete on return.
  m.def("shm_all_reduce_start(Tensor input, str reduce_op, str group_name) -> Tensor");
  m.def("shm_all_gather_into_tensor_start(Tensor input, int group_size, str group_name) -> Tensor");
  m.def("shm_reduce_scatter_tensor_start(Tensor input, str reduce_op, int group_size, str group_name) -> Tensor");
  m.def("shm_wait(Tensor tensor) -> Tensor");
  // A gradient bucket's flatten (into the registered input region at input_offset_bytes) and started all_reduce.
  m.def("shm_flatten_all_reduce_start(Tensor[] inputs, int input_offset_bytes, str reduce_op, str group_name) "
        "-> Tensor");
  // Group management (not traced: called by adaptdist.kernels.shm); catch-all kernels.
  m.def("_shm_group_attach(str group_name, str segment, int group_rank, int group_size, int global_rank, "
        "int slot_bytes, float timeout_s, int spin_ns, bool create) -> ()",
        &adaptdist_shm::group_attach);
  m.def("_shm_group_wait_attached(str group_name) -> ()", &adaptdist_shm::group_wait_attached);
  m.def("_shm_group_destroy(str group_name) -> ()", &adaptdist_shm::group_destroy);
  m.def("_shm_group_names() -> str[]", &adaptdist_shm::group_names_impl);
  m.def("_shm_group_pids(str group_name) -> int[]", &adaptdist_shm::group_pids);
  m.def("_shm_group_profile(str group_name) -> float[]", &adaptdist_shm::group_profile);
  m.def("_shm_group_set_comm_thread(str group_name, bool on) -> ()", &adaptdist_shm::group_set_comm_thread);
  m.def("_shm_group_input_buffer(str group_name, int offset_bytes, int numel, ScalarType dtype) -> Tensor",
        &adaptdist_shm::group_input_buffer);
  m.def("_shm_group_input_region_bytes(str group_name) -> int", &adaptdist_shm::group_input_region_bytes);
  m.def("_abi_version() -> int", &adaptdist_shm::abi_version);
}

TORCH_LIBRARY_IMPL(adaptdist, CPU, m) {
  m.impl("shm_all_reduce", &adaptdist_shm::all_reduce_entry);
  m.impl("shm_all_gather_into_tensor", &adaptdist_shm::all_gather_entry);
  m.impl("shm_reduce_scatter_tensor", &adaptdist_shm::reduce_scatter_entry);
  m.impl("shm_all_to_all_single", &adaptdist_shm::all_to_all_entry);
  m.impl("shm_broadcast", &adaptdist_shm::broadcast_entry);
  m.impl("shm_all_reduce_start", &adaptdist_shm::all_reduce_start);
  m.impl("shm_all_gather_into_tensor_start", &adaptdist_shm::all_gather_start);
  m.impl("shm_reduce_scatter_tensor_start", &adaptdist_shm::reduce_scatter_start);
  m.impl("shm_wait", &adaptdist_shm::shm_wait);
  m.impl("shm_flatten_all_reduce_start", &adaptdist_shm::flatten_all_reduce_start);
}

TORCH_LIBRARY_IMPL(adaptdist, Meta, m) {
  m.impl("shm_all_reduce", &adaptdist_shm::all_reduce_meta);
  m.impl("shm_all_gather_into_tensor", &adaptdist_shm::all_gather_meta);
  m.impl("shm_reduce_scatter_tensor", &adaptdist_shm::reduce_scatter_meta);
  m.impl("shm_all_to_all_single", &adaptdist_shm::all_to_all_meta);
  m.impl("shm_broadcast", &adaptdist_shm::broadcast_meta);
  m.impl("shm_all_reduce_start", &adaptdist_shm::all_reduce_meta);
  m.impl("shm_all_gather_into_tensor_start", &adaptdist_shm::all_gather_meta);
  m.impl("shm_reduce_scatter_tensor_start", &adaptdist_shm::reduce_scatter_meta);
  m.impl("shm_wait", &adaptdist_shm::wait_meta);
  m.impl("shm_flatten_all_reduce_start", &adaptdist_shm::flatten_all_reduce_meta);
}
