// emulated_cuda/block.h: one block of a kernel whose threads cooperate, run on one CPU thread.
//
// Each emulated thread is a fiber (emulated_cuda/fibers.h). The block's scheduler resumes the
// threads that are ready, one at a time; a thread runs until it waits (at __syncthreads, or at a
// warp collective such as __shfl_down_sync) or returns. A barrier lets its threads go once every
// thread of the block waits at it; a warp collective, once every lane its mask names waits at it,
// and then hands each lane its result (the value it reads, the vote). Which ready thread runs
// next is the CUDA programming model's business, not the kernel's: in order of threadIdx by
// default, drawn at random under WORKBOOK_EMULATE_ORDER=shuffle.
//
// synccheck: when no thread is ready and some have not returned, the block cannot go on. On a
// GPU that is a hang or undefined behaviour; here it is a launch failure whose message names the
// kernel, the block, each group of threads and where each waits (file:line), or that it
// returned. The same holds for threads that all wait, but at different barriers, and for a warp
// collective whose lanes disagree on the mask or the operation.
//
// Shared memory: a kernel's `__shared__` variables (the source pass turns each declaration into
// a call of shared_variable) and its `extern __shared__` array (dynamic_shared) live in the
// block's SharedMemory, allocated when a thread of the block first reaches the declaration and
// gone when the block ends. It starts filled with 0xff bytes (a NaN in every float type), so a
// read before any write shows. AddressSanitizer sees each variable as an allocation of its own,
// so an access past one is reported there.
//
// racecheck (ThreadSanitizer, make racecheck): every emulated thread is a ThreadSanitizer fiber,
// and the emulator tells it what orders memory on a GPU: a barrier (each thread releases at
// arrival and acquires when it passes), __syncwarp among the lanes of its mask, the start and
// the end of a launch. Nothing else does: switching fibers does not, nor do shuffles and votes
// (they move values, not memory), and atomics are relaxed, as CUDA's are. So two emulated
// threads that touch one address, one of them writing, with no barrier between them, are a race
// that ThreadSanitizer reports with both lines. Every kernel, cooperating or not, runs this way
// under racecheck, on one CPU thread.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "emulated_cuda/fibers.h"

namespace workbook::emulate {

// Where a barrier or collective is called from: its caller's file and line (the source pass keeps
// a kernel's lines, and names its file with #line).
struct Site {
  const char* file = "?";
  unsigned line = 0;
};

// What a launch knows of its kernel, from the source pass: its name, and whether it (or a
// function it calls) uses a barrier, shared memory or a warp collective.
struct Kernel {
  const char* name;
  bool cooperates;
};

// The operations threads wait at: the block's barrier, and the warp's.
enum class Op : uint8_t {
  syncthreads,
  syncthreads_count,
  syncthreads_and,
  syncthreads_or,
  syncwarp,
  shfl,
  shfl_up,
  shfl_down,
  shfl_xor,
  ballot,
  any,
  all,
  activemask,
};

inline const char* op_name(Op op) {
  switch (op) {
    case Op::syncthreads:
      return "__syncthreads";
    case Op::syncthreads_count:
      return "__syncthreads_count";
    case Op::syncthreads_and:
      return "__syncthreads_and";
    case Op::syncthreads_or:
      return "__syncthreads_or";
    case Op::syncwarp:
      return "__syncwarp";
    case Op::shfl:
      return "__shfl_sync";
    case Op::shfl_up:
      return "__shfl_up_sync";
    case Op::shfl_down:
      return "__shfl_down_sync";
    case Op::shfl_xor:
      return "__shfl_xor_sync";
    case Op::ballot:
      return "__ballot_sync";
    case Op::any:
      return "__any_sync";
    case Op::all:
      return "__all_sync";
    case Op::activemask:
      return "__activemask";
  }
  return "?";
}

inline bool is_block_barrier(Op op) { return op <= Op::syncthreads_or; }

// CUDA's limits on shared memory per block (an H200's): 48 KB of __shared__ variables, and
// 227 KB in all with the dynamic memory a launch opts in to.
inline constexpr std::size_t kStaticSharedLimit = 49152;
inline constexpr std::size_t kSharedLimit = 232448;
// The largest value a warp shuffle moves here (CUDA's intrinsics take up to 8 bytes; cooperative
// groups' shfl any trivially copyable type, which this covers up to 32 bytes).
inline constexpr std::size_t kMaxShuffleBytes = 32;

// ----------------------------------------------------------------------------------------------
// Shared memory of one block

class SharedMemory {
 public:
  enum class Refusal { none, static_limit, total_limit, too_many };

  // Before the block's first thread runs, on the CPU thread that runs it.
  WORKBOOK_EMULATOR_INTERNAL void begin(std::size_t dynamic_bytes) {
    dynamic_bytes_ = dynamic_bytes;
    static_bytes_ = 0;
    entries_.clear();
    entries_.reserve(kMaxVariables);
#if defined(__SANITIZE_THREAD__)
    // A fresh mapping for every block: ThreadSanitizer forgets what earlier blocks did to these
    // addresses (on a GPU each block has shared memory of its own), and what the CPU thread wrote
    // here (the 0xff fill) is ordered before the block's threads by their start (start_object).
    arena_size_ = kSyncBytes + kStaticSharedLimit + round_up(dynamic_bytes, 64);
    void* arena =
        mmap(nullptr, arena_size_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (arena == MAP_FAILED) fatal("no memory for a block's shared memory");
    arena_ = static_cast<char*>(arena);
    std::memset(arena_ + kSyncBytes, 0xff, arena_size_ - kSyncBytes);
    used_ = 0;
    dynamic_ = arena_ + kSyncBytes + kStaticSharedLimit;
#else
    dynamic_ = allocate(dynamic_bytes, 16);
#endif
  }

  // After the block's last thread, on the same CPU thread.
  WORKBOOK_EMULATOR_INTERNAL void end() {
#if defined(__SANITIZE_THREAD__)
    munmap(arena_, arena_size_);
    arena_ = nullptr;
#else
    for (const Entry& e : entries_) ::operator delete(e.data, std::align_val_t{e.align});
    ::operator delete(dynamic_, std::align_val_t{16});
#endif
    entries_.clear();
    dynamic_ = nullptr;
  }

  WORKBOOK_EMULATOR_INTERNAL void* dynamic() const { return dynamic_; }
  WORKBOOK_EMULATOR_INTERNAL std::size_t dynamic_bytes() const { return dynamic_bytes_; }
  WORKBOOK_EMULATOR_INTERNAL std::size_t static_bytes() const { return static_bytes_; }

  // The variable declared where `key` names (one key per declaration and template instance):
  // the block's, allocated by the first thread that reaches it. Null, with `refusal` set, where
  // CUDA would not have it.
  WORKBOOK_EMULATOR_INTERNAL void* variable(const void* key, std::size_t size, std::size_t align,
                                            Refusal* refusal) {
    for (const Entry& e : entries_) {
      if (e.key == key) return e.data;
    }
    *refusal = Refusal::none;
    align = std::max<std::size_t>(align, 16);
    const std::size_t offset = round_up(static_bytes_, align);
    if (offset + size > kStaticSharedLimit) {
      static_bytes_ = offset + size;
      *refusal = Refusal::static_limit;
      return nullptr;
    }
    if (offset + size + dynamic_bytes_ > kSharedLimit) {
      static_bytes_ = offset + size;
      *refusal = Refusal::total_limit;
      return nullptr;
    }
    if (entries_.size() == kMaxVariables) {
      *refusal = Refusal::too_many;
      return nullptr;
    }
    static_bytes_ = offset + size;
#if defined(__SANITIZE_THREAD__)
    void* data = arena_ + kSyncBytes + offset;
#else
    void* data = allocate(size, align);
#endif
    entries_.push_back({key, data, size, align});
    return data;
  }

  // ThreadSanitizer's synchronisation objects of the block (fresh for each block): where a
  // thread's start, the block's barrier and each group of lanes' __syncwarp release and acquire.
  // A barrier has two, used in turn: a thread that has passed one barrier can arrive at the next
  // (and release) before a slower one has passed the first (and acquired), and what it did in
  // between must not reach the slower one through the same object. It cannot arrive at the one
  // after before the slower one has arrived at the next, so two are enough.
  WORKBOOK_EMULATOR_INTERNAL void* start_object() { return sync_slot(0); }
  WORKBOOK_EMULATOR_INTERNAL void* barrier_object(unsigned parity) { return sync_slot(1 + parity); }
  WORKBOOK_EMULATOR_INTERNAL void* warp_object(unsigned group, unsigned parity) {
    return sync_slot(3 + 2 * group + parity);
  }

 private:
  static constexpr std::size_t kMaxVariables = 64;
  static constexpr std::size_t kSyncBytes = 8 * (3 + 2 * 32 * 32);

  struct Entry {
    const void* key;
    void* data;
    std::size_t size, align;
  };

  static std::size_t round_up(std::size_t n, std::size_t to) { return (n + to - 1) / to * to; }

#if defined(__SANITIZE_THREAD__)
  WORKBOOK_EMULATOR_INTERNAL void* sync_slot(std::size_t i) { return arena_ + 8 * i; }
  char* arena_ = nullptr;
  std::size_t arena_size_ = 0, used_ = 0;
#else
  WORKBOOK_EMULATOR_INTERNAL void* sync_slot(std::size_t i) { return &sync_[i < 1 ? i : 1]; }
  char sync_[2] = {};
  // Each variable its own allocation, filled with 0xff: AddressSanitizer puts a red zone around it.
  static void* allocate(std::size_t size, std::size_t align) {
    void* data = ::operator new(std::max<std::size_t>(size, 1), std::align_val_t{align});
    std::memset(data, 0xff, size);
    return data;
  }
#endif

  std::vector<Entry> entries_;
  std::size_t static_bytes_ = 0, dynamic_bytes_ = 0;
  void* dynamic_ = nullptr;
};

// ----------------------------------------------------------------------------------------------
// The block

// What a fiber runs: the kernel's body for the thread whose indices are set.
struct Body {
  void (*call)(const void* self);
  const void* self;
};

class Block {
 public:
  // Runs block `index` of the launch with `threads` threads (blockDim) and `dynamic_shared` bytes
  // of dynamic shared memory; returns "" or why the block could not finish (synccheck). `first`
  // is the block's first thread's index in the whole grid (which racecheck identity each uses);
  // `shuffle`, a generator to draw the next thread from, or null for threadIdx order.
  WORKBOOK_EMULATOR_INTERNAL std::string run(const Kernel& kernel, uint3 index, dim3 grid,
                                             dim3 block, std::size_t dynamic_shared, Body body,
                                             uint64_t first, std::mt19937_64* shuffle);

  // -- what the emulated threads call (on their fibers) ----------------------------------------

  // The block's barrier: every thread waits here until all have arrived; returns the count,
  // and, or or of the predicates for the __syncthreads_* variants.
  WORKBOOK_EMULATOR_INTERNAL int barrier(Op op, int predicate, Site site);

  // A warp collective among the lanes `mask` names: `value` (value_size bytes) is this lane's
  // contribution to a shuffle; `out` receives what the lane reads. `arg` is the shuffle's
  // source lane, delta or lane mask; `width` its segment. Returns the vote for ballot, any, all.
  WORKBOOK_EMULATOR_INTERNAL unsigned collective(Op op, unsigned mask, const void* value, void* out,
                                                 std::size_t value_size, int arg, int width,
                                                 int predicate, Site site);

  // The lanes of this thread's warp that have not returned.
  WORKBOOK_EMULATOR_INTERNAL unsigned active_mask() const;

  WORKBOOK_EMULATOR_INTERNAL void* shared_variable(const void* key, std::size_t size,
                                                   std::size_t align, Site site);
  WORKBOOK_EMULATOR_INTERNAL void* dynamic_shared() const { return shared_.dynamic(); }

  // What a fiber can find wrong, for the scheduler to put in words.
  enum class Problem : uint8_t {
    lane_not_in_mask,    // detail: the calling lane
    lanes_past_block,    // detail: the mask's lanes that do not exist
    bad_width,           // detail: the width
    source_not_in_mask,  // detail: the lane read
    static_limit,        // detail: the bytes of __shared__ variables
    total_limit,         // detail: the same, with the dynamic shared memory
    too_many_variables,
    exception,
  };

  // Called from a fiber where CUDA's rules are broken: the block stops (this fiber never
  // resumes) and the launch fails with the message the scheduler writes.
  [[noreturn]] WORKBOOK_EMULATOR_INTERNAL void fail(const char* construct, Site site,
                                                    Problem problem, unsigned detail = 0);

  WORKBOOK_EMULATOR_INTERNAL bool cooperates() const { return kernel_->cooperates; }

  // The exception a thread of the last block threw (a TORCH_CHECK in a kernel: an exercise's
  // stub), for the launch to throw again as a kernel run one thread at a time would; null if none.
  std::exception_ptr take_exception() { return std::exchange(exception_, nullptr); }

 private:
  enum class State : uint8_t { ready, waiting, finished };

  struct Thread {
    uint3 index{};
    unsigned linear = 0;
    State state = State::ready;
    Op op = Op::syncthreads;
    Site site{};
    unsigned mask = 0;
    int arg = 0, width = 32, predicate = 0;
    unsigned vote = 0;
    unsigned parity = 0;  // which of its barrier's (or warp group's) two objects it released
    std::size_t value_size = 0;
    unsigned char value[kMaxShuffleBytes] = {};
    unsigned char result[kMaxShuffleBytes] = {};
    Fiber fiber;
  };

  // The stack and racecheck identity one emulated thread runs with. Under racecheck a pool for
  // the process, the thread with grid index g taking slot g mod kRacecheckSlots, so that the
  // threads of one block, and of neighbouring blocks, are told apart (a race between two threads
  // whose grid indices differ by a multiple of the pool's size goes unseen); otherwise a pool for
  // each CPU thread, one slot per thread of the block.
  struct Slot {
    Stack stack;
    Identity identity;
  };
  static constexpr std::size_t kRacecheckSlots = 1024;
  static std::vector<std::unique_ptr<Slot>>& slots() {
#if defined(__SANITIZE_THREAD__)
    static std::vector<std::unique_ptr<Slot>> pool;
#else
    static thread_local std::vector<std::unique_ptr<Slot>> pool;
#endif
    return pool;
  }
  WORKBOOK_EMULATOR_INTERNAL Slot& slot_for(unsigned thread);

  WORKBOOK_EMULATOR_INTERNAL static void enter(void* thread);
  WORKBOOK_EMULATOR_INTERNAL void wait_here();
  WORKBOOK_EMULATOR_INTERNAL void wake(unsigned thread);
  WORKBOOK_EMULATOR_INTERNAL void pass_barrier();
  WORKBOOK_EMULATOR_INTERNAL void pass_collective(unsigned warp, unsigned mask);
  // No thread can go on: who waits where, and who returned, under `headline` (or one that says
  // which kind of wait it is).
  WORKBOOK_EMULATOR_INTERNAL std::string stuck(const std::string& headline = "") const;
  std::string threads_text(const std::vector<unsigned>& linear) const;
  std::string header() const;
  std::string where(Op op, Site site) const;

  const Kernel* kernel_ = nullptr;
  uint3 index_{};
  dim3 grid_{}, block_{};
  uint64_t first_ = 0;
  Body body_{};
  std::vector<Thread> threads_;
  std::vector<unsigned> ready_;  // a ring of thread numbers: ready_head_ .. + ready_count_
  std::size_t ready_head_ = 0, ready_count_ = 0;
  std::vector<unsigned> warp_waiting_;  // per warp, the lanes waiting at a collective
  // How many times the block's barrier, and each group of lanes' __syncwarp (warp x 32 + its
  // first lane), has let its threads go: the parity picks the racecheck object.
  unsigned barriers_passed_ = 0;
  std::vector<unsigned> syncwarps_passed_;
  unsigned at_barrier_ = 0, finished_ = 0, current_ = 0;
  std::mt19937_64* shuffle_ = nullptr;
  SharedMemory shared_;
  unsigned count_ = 0;  // threads in the block
  // A failure a fiber found, put in words by the scheduler (on the CPU thread's identity: what a
  // fiber allocates, ThreadSanitizer would see another identity free).
  struct Failure {
    bool set = false;
    bool mismatch = false;  // threads that met disagree on the barrier or collective
    const char* construct = "";
    Site site{};
    Problem problem{};
    unsigned thread = 0, detail = 0;
  } failure_;
  WORKBOOK_EMULATOR_INTERNAL std::string describe(const Failure& f) const;
  std::exception_ptr exception_;
};

// The block whose threads run on this CPU thread (null outside a cooperating launch).
inline thread_local Block* running_block = nullptr;

// What every emulated thread releases when it returns, and the CPU thread acquires when the
// launch ends: under racecheck, the end of a launch orders its threads' work before what follows.
inline char launch_end_object = 0;

// ----------------------------------------------------------------------------------------------
// The scheduler (on the CPU thread)

inline Block::Slot& Block::slot_for(unsigned thread) {
  auto& pool = slots();
#if defined(__SANITIZE_THREAD__)
  const std::size_t i = (first_ + thread) % kRacecheckSlots;
#else
  const std::size_t i = thread;
#endif
  if (pool.size() <= i) pool.resize(i + 1);
  if (!pool[i]) pool[i] = std::make_unique<Slot>();
  return *pool[i];
}

inline std::string Block::run(const Kernel& kernel, uint3 index, dim3 grid, dim3 block,
                              std::size_t dynamic_shared, Body body, uint64_t first,
                              std::mt19937_64* shuffle) {
  const Unseen unseen;
  kernel_ = &kernel;
  index_ = index;
  grid_ = grid;
  block_ = block;
  body_ = body;
  first_ = first;
  shuffle_ = shuffle;
  count_ = block.x * block.y * block.z;
  if (threads_.size() < count_) threads_ = std::vector<Thread>(count_);
  ready_.assign(count_, 0);
  ready_head_ = ready_count_ = 0;
  warp_waiting_.assign((count_ + 31) / 32, 0);
  syncwarps_passed_.assign(warp_waiting_.size() * 32, 0);
  barriers_passed_ = 0;
  at_barrier_ = finished_ = 0;
  failure_ = Failure{};
  shared_.begin(dynamic_shared);
  release(shared_.start_object());  // what the CPU thread did so far, before every thread starts
  for (unsigned t = 0; t < count_; ++t) {
    Thread& thread = threads_[t];
    thread.index = {t % block.x, t / block.x % block.y, t / (block.x * block.y)};
    thread.linear = t;
    Slot& slot = slot_for(t);
    thread.fiber.start(&slot.stack, slot.identity.get(), &Block::enter, &thread);
    wake(t);
  }
  Block* outer = running_block;
  running_block = this;
  while (ready_count_ > 0 && !failure_.set) {
    std::size_t pick = 0;
    if (shuffle_ != nullptr) pick = (*shuffle_)() % ready_count_;
    const std::size_t at = (ready_head_ + pick) % count_;
    current_ = ready_[at];
    ready_[at] = ready_[ready_head_];
    ready_head_ = (ready_head_ + 1) % count_;
    --ready_count_;
    threadIdx = threads_[current_].index;
    threads_[current_].fiber.resume();
  }
  running_block = outer;
  std::string problem;
  if (failure_.set && exception_ != nullptr) {
    problem = "the kernel threw";  // the launch throws exception_ again
  } else if (failure_.set) {
    problem = describe(failure_);
  } else if (finished_ < count_) {
    problem = stuck();
  }
  if (!problem.empty()) {
    // The threads left mid-kernel: what they did is ordered before the launch's end as if they
    // had returned, then their stacks and identities forget their frames.
    void* host = current_identity();
    for (unsigned t = 0; t < count_; ++t) {
      if (threads_[t].state == State::finished) continue;
      Slot& slot = slot_for(t);
      switch_identity(slot.identity.get());
      release(&launch_end_object);
      switch_identity(host);
      slot.stack.forget_frames();
      slot.identity.reset();
    }
  }
  shared_.end();
  return problem;
}

inline void Block::wake(unsigned thread) {
  threads_[thread].state = State::ready;
  ready_[(ready_head_ + ready_count_) % count_] = thread;
  ++ready_count_;
}

// -- on the fibers ------------------------------------------------------------------------------

inline void Block::enter(void* argument) {
  Thread& thread = *static_cast<Thread*>(argument);
  Block& block = *running_block;
  acquire(block.shared_.start_object());
  try {
    block.body_.call(block.body_.self);  // the kernel, seen by ThreadSanitizer
  } catch (...) {
    block.exception_ = std::current_exception();
    block.fail("the kernel", Site{}, Problem::exception);
  }
  release(&launch_end_object);
  const Unseen unseen;
  thread.state = State::finished;
  ++block.finished_;
}

inline void Block::wait_here() { threads_[current_].fiber.suspend(); }

// (Never within an Unseen: an identity must not be left, or destroyed, ignoring its accesses.)
inline void Block::fail(const char* construct, Site site, Problem problem, unsigned detail) {
  failure_ = Failure{true, false, construct, site, problem, current_, detail};
  threads_[current_].fiber.suspend();
  fatal("a failed block's thread was resumed");
}

inline bool same_site(Site a, Site b) {
  return a.line == b.line && std::strcmp(a.file, b.file) == 0;
}

inline int Block::barrier(Op op, int predicate, Site site) {
  Thread& thread = threads_[current_];
  {
    const Unseen unseen;
    thread.op = op;
    thread.site = site;
    thread.predicate = predicate != 0;
    thread.state = State::waiting;
    thread.parity = barriers_passed_ & 1u;
    release(shared_.barrier_object(thread.parity));
    if (++at_barrier_ == count_) pass_barrier();
  }
  wait_here();
  acquire(shared_.barrier_object(thread.parity));
  return static_cast<int>(thread.vote);
}

// Every thread of the block waits at a barrier: the same one, or the block has failed.
inline void Block::pass_barrier() {
  const Thread& first = threads_[0];
  unsigned count = 0;
  for (unsigned t = 0; t < count_; ++t) {
    const Thread& thread = threads_[t];
    if (thread.op != first.op || !same_site(thread.site, first.site)) {
      failure_ = Failure{true, true, op_name(thread.op), thread.site, {}, t, 0};
      return;
    }
    count += static_cast<unsigned>(thread.predicate);
  }
  const unsigned vote = first.op == Op::syncthreads_count ? count
                        : first.op == Op::syncthreads_and ? unsigned{count == count_}
                                                          : unsigned{count > 0};
  at_barrier_ = 0;
  ++barriers_passed_;
  for (unsigned t = 0; t < count_; ++t) {
    threads_[t].vote = vote;
    wake(t);
  }
}

// Byte copies the sanitizers do not look into (a call of memcpy would be ThreadSanitizer's).
WORKBOOK_EMULATOR_INTERNAL inline void copy_bytes(void* to, const void* from, std::size_t n) {
  auto* out = static_cast<volatile unsigned char*>(to);
  const auto* in = static_cast<const volatile unsigned char*>(from);
  for (std::size_t i = 0; i < n; ++i) out[i] = in[i];
}

inline unsigned Block::collective(Op op, unsigned mask, const void* value, void* out,
                                  std::size_t value_size, int arg, int width, int predicate,
                                  Site site) {
  Thread& thread = threads_[current_];
  const unsigned lane = thread.linear % 32, warp = thread.linear / 32;
  const unsigned lanes = std::min(32u, count_ - warp * 32);
  const unsigned present = lanes == 32 ? ~0u : (1u << lanes) - 1;
  if ((mask >> lane & 1u) == 0) fail(op_name(op), site, Problem::lane_not_in_mask, lane);
  if ((mask & ~present) != 0) fail(op_name(op), site, Problem::lanes_past_block, mask & ~present);
  if (width < 1 || width > 32 || (width & (width - 1)) != 0) {
    fail(op_name(op), site, Problem::bad_width, static_cast<unsigned>(width));
  }
  const unsigned group = warp * 32 + static_cast<unsigned>(__builtin_ctz(mask));
  {
    const Unseen unseen;
    thread.op = op;
    thread.site = site;
    thread.mask = mask;
    thread.arg = arg;
    thread.width = width;
    thread.predicate = predicate != 0;
    thread.value_size = value_size;
    copy_bytes(thread.value, value, value_size);
    thread.state = State::waiting;
    thread.parity = syncwarps_passed_[group] & 1u;
    if (op == Op::syncwarp) release(shared_.warp_object(group, thread.parity));
    warp_waiting_[warp] |= 1u << lane;
    if ((warp_waiting_[warp] & mask) == mask) pass_collective(warp, mask);
  }
  wait_here();
  if (op == Op::syncwarp) acquire(shared_.warp_object(group, thread.parity));
  copy_bytes(out, thread.result, value_size);
  return thread.vote;
}

// Every lane `mask` names waits at a collective of `warp`: the same one, or the block has failed.
inline void Block::pass_collective(unsigned warp, unsigned mask) {
  Thread* lane0 = &threads_[warp * 32];
  const Thread& caller = threads_[current_];
  unsigned votes = 0;
  for (unsigned l = 0; l < 32; ++l) {
    if ((mask >> l & 1u) == 0) continue;
    const Thread& t = lane0[l];
    if (t.op != caller.op || t.mask != caller.mask || t.width != caller.width) {
      failure_ = Failure{true, true, op_name(t.op), t.site, {}, warp * 32 + l, warp};
      return;
    }
    votes |= static_cast<unsigned>(t.predicate) << l;
  }
  for (unsigned l = 0; l < 32; ++l) {
    if ((mask >> l & 1u) == 0) continue;
    Thread& t = lane0[l];
    const auto w = static_cast<unsigned>(t.width);
    const unsigned segment = l & ~(w - 1);
    const auto arg = static_cast<unsigned>(t.arg);
    unsigned source = l;
    switch (t.op) {
      case Op::shfl:  // srcLane mod width, within the lane's segment
        source = segment + static_cast<unsigned>(((t.arg % t.width) + t.width) % t.width);
        break;
      case Op::shfl_up:  // below the segment: the lane keeps its own value
        source = arg <= l - segment ? l - arg : l;
        break;
      case Op::shfl_down:  // past the segment: its own value
        source = arg < segment + w - l ? l + arg : l;
        break;
      case Op::shfl_xor:  // into a later segment: its own value
        source = (l ^ arg) < segment + w ? l ^ arg : l;
        break;
      default:
        break;
    }
    if (source >= 32 || (mask >> source & 1u) == 0) {
      failure_ = Failure{true,          false, op_name(t.op), t.site, Problem::source_not_in_mask,
                         warp * 32 + l, source};
      return;
    }
    copy_bytes(t.result, lane0[source].value, t.value_size);
    t.vote = t.op == Op::ballot ? votes
             : t.op == Op::any  ? unsigned{votes != 0}
             : t.op == Op::all  ? unsigned{votes == mask}
                                : 0u;
  }
  warp_waiting_[warp] &= ~mask;
  ++syncwarps_passed_[warp * 32 + static_cast<unsigned>(__builtin_ctz(mask))];
  for (unsigned l = 0; l < 32; ++l) {
    if ((mask >> l & 1u) != 0) wake(warp * 32 + l);
  }
}

inline unsigned Block::active_mask() const {
  const Unseen unseen;
  const unsigned warp = current_ / 32;
  unsigned mask = 0;
  for (unsigned l = 0; l < 32 && warp * 32 + l < count_; ++l) {
    if (threads_[warp * 32 + l].state != State::finished) mask |= 1u << l;
  }
  return mask;
}

inline void* Block::shared_variable(const void* key, std::size_t size, std::size_t align,
                                    Site site) {
  SharedMemory::Refusal refusal = SharedMemory::Refusal::none;
  void* data = nullptr;
  {
    const Unseen unseen;
    data = shared_.variable(key, size, align, &refusal);
  }
  if (data != nullptr) return data;
  const auto bytes = static_cast<unsigned>(shared_.static_bytes());
  if (refusal == SharedMemory::Refusal::static_limit) {
    fail("__shared__", site, Problem::static_limit, bytes);
  }
  if (refusal == SharedMemory::Refusal::total_limit) {
    fail("__shared__", site, Problem::total_limit, bytes);
  }
  fail("__shared__", site, Problem::too_many_variables);
}

// -- the reports (on the CPU thread) -------------------------------------------------------------

inline std::string dims_text(unsigned x, unsigned y, unsigned z) {
  return "(" + std::to_string(x) + ", " + std::to_string(y) + ", " + std::to_string(z) + ")";
}

inline std::string site_text(Site site) {
  return std::string(site.file) + ":" + std::to_string(site.line);
}

// Lane numbers in runs: "0..15, 20".
inline std::string lanes_text(unsigned mask) {
  std::string out;
  for (unsigned l = 0; l < 32;) {
    if ((mask >> l & 1u) == 0) {
      ++l;
      continue;
    }
    unsigned end = l;
    while (end + 1 < 32 && (mask >> (end + 1) & 1u) != 0) ++end;
    out +=
        (out.empty() ? "" : ", ") + std::to_string(l) + (end > l ? ".." + std::to_string(end) : "");
    l = end + 1;
  }
  return out;
}

inline std::string Block::header() const {
  return "synccheck: kernel `" + std::string(kernel_->name) + "`, block " +
         dims_text(index_.x, index_.y, index_.z) + " of a grid of " +
         dims_text(grid_.x, grid_.y, grid_.z) + ", blockDim " +
         dims_text(block_.x, block_.y, block_.z);
}

// Threads in runs: "threads 0..15, 20" in a 1-D block, threadIdx triples otherwise.
inline std::string Block::threads_text(const std::vector<unsigned>& linear) const {
  const bool flat = block_.y == 1 && block_.z == 1;
  auto one = [&](unsigned t) {
    return flat ? std::to_string(t)
                : dims_text(t % block_.x, t / block_.x % block_.y, t / (block_.x * block_.y));
  };
  std::string out = linear.size() == 1 ? "thread " : "threads ";
  std::size_t runs = 0;
  for (std::size_t i = 0; i < linear.size();) {
    std::size_t end = i;
    while (end + 1 < linear.size() && linear[end + 1] == linear[end] + 1) ++end;
    if (++runs > 8) {
      out += ", and " + std::to_string(linear.size() - i) + " more";
      break;
    }
    out += (i == 0 ? "" : ", ") + one(linear[i]) + (end > i ? ".." + one(linear[end]) : "");
    i = end + 1;
  }
  return out;
}

inline std::string Block::where(Op op, Site site) const {
  return "`" + std::string(op_name(op)) + "` (" + site_text(site) + ")";
}

inline std::string Block::describe(const Failure& f) const {
  if (f.mismatch && !is_block_barrier(threads_[f.thread].op)) {
    return stuck("the lanes of warp " + std::to_string(f.detail) +
                 " that meet disagree on the collective (its operation, mask or width)");
  }
  if (f.mismatch) return stuck();
  if (f.problem == Problem::exception) {
    return header() + ": a C++ exception left the kernel in " + threads_text({f.thread});
  }
  std::string what;
  switch (f.problem) {
    case Problem::lane_not_in_mask:
      what = "lane " + std::to_string(f.detail) + " calls it with a mask that leaves it out";
      break;
    case Problem::lanes_past_block:
      what = "its mask names lanes " + lanes_text(f.detail) +
             ", which this warp does not have (the block ends before them)";
      break;
    case Problem::bad_width:
      what = "its width, " + std::to_string(f.detail) + ", is not a power of 2 from 1 to 32";
      break;
    case Problem::source_not_in_mask:
      what = "it reads lane " + std::to_string(f.detail) + ", which its mask leaves out";
      break;
    case Problem::static_limit:
      what = "the block's __shared__ variables come to " + std::to_string(f.detail) +
             " bytes, past CUDA's limit of " + std::to_string(kStaticSharedLimit);
      break;
    case Problem::total_limit:
      what = "the block's __shared__ variables (" + std::to_string(f.detail) +
             " bytes) and its dynamic shared memory (" + std::to_string(shared_.dynamic_bytes()) +
             ") are past the H200's " + std::to_string(kSharedLimit);
      break;
    default:
      what = "the emulator takes at most 64 __shared__ variables a block";
      break;
  }
  return header() + ": `" + f.construct + "` (" + site_text(f.site) + "), in " +
         threads_text({f.thread}) + ": " + what;
}

inline std::string Block::stuck(const std::string& headline) const {
  struct Group {
    State state;
    Op op;
    Site site;
    unsigned mask, warp;
    std::vector<unsigned> threads;
  };
  std::vector<Group> groups;
  unsigned barriers = 0;
  for (unsigned t = 0; t < count_; ++t) {
    const Thread& thread = threads_[t];
    const bool waiting = thread.state == State::waiting;
    const bool barrier = waiting && is_block_barrier(thread.op);
    const unsigned warp = waiting && !barrier ? t / 32 : 0;
    auto same = [&](const Group& g) {
      if (g.state != thread.state) return false;
      if (!waiting) return true;
      return g.op == thread.op && same_site(g.site, thread.site) &&
             (barrier || (g.mask == thread.mask && g.warp == warp));
    };
    auto found = std::find_if(groups.begin(), groups.end(), same);
    if (found == groups.end()) {
      barriers += static_cast<unsigned>(barrier);
      groups.push_back({thread.state, thread.op, thread.site, thread.mask, warp, {}});
      found = groups.end() - 1;
    }
    found->threads.push_back(t);
  }
  std::string out = header() + ": ";
  out += !headline.empty() ? headline
         : barriers > 1    ? "its threads wait at different barriers"
         : barriers > 0    ? "a barrier that not every thread of the block reaches"
                           : "a warp collective whose lanes do not all arrive";
  for (const Group& g : groups) {
    out += "\n  " + threads_text(g.threads) + ": ";
    if (g.state == State::finished) {
      out += "returned";
    } else if (g.state != State::waiting) {
      out += "ready";
    } else if (is_block_barrier(g.op)) {
      out += "wait at " + where(g.op, g.site);
    } else {
      char mask[16];
      std::snprintf(mask, sizeof mask, "0x%08x", g.mask);
      const unsigned missing = g.mask & ~warp_waiting_[g.warp];
      out += "wait at " + where(g.op, g.site) + " with mask " + mask;
      if (missing != 0) {
        out += ", for lanes " + lanes_text(missing) + " of warp " + std::to_string(g.warp) +
               ", which are not there";
      }
    }
  }
  return out;
}

}  // namespace workbook::emulate
