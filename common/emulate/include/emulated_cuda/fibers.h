// emulated_cuda/fibers.h: the stacks and context switches that let the emulated threads of one
// block wait for each other on one CPU thread.
//
// A block whose kernel cooperates (barriers, shared memory, warp collectives) runs each of its
// threads as a fiber: a stack of its own, entered from the block's scheduler and left again at
// every barrier and warp collective, so that all threads of the block reach a barrier before any
// passes it. Two ways to switch, chosen when the emulated kernels are compiled
// (workbook/build/emulate.py):
//
//   Boost.Context's fcontext (WORKBOOK_EMULATE_FIBERS_BOOST; Debian's libboost-context-dev): a
//     few instructions that save the callee-saved registers and the stack pointer;
//   ucontext (swapcontext, glibc), where Boost.Context is not installed: the same, plus a
//     system call per switch that saves and restores the signal mask.
//
// `python -m workbook.build.emulate fibers` measures both on this machine.
//
// Every stack has a guard page below it (stacks grow down): a kernel that overflows its stack
// faults at once instead of writing over the stack beside it. The sanitizers are told of every
// switch, as they require of a fiber library: AddressSanitizer (make sanitize), which must know
// which stack is current to check stack accesses and unwind, and ThreadSanitizer (make
// racecheck), for which each emulated thread is a fiber of its own (`Identity`), so that two
// emulated threads that touch one address without a barrier between them are a race.
#pragma once

#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>

#if defined(WORKBOOK_EMULATE_FIBERS_BOOST)
#include <boost/context/detail/fcontext.hpp>
#else
#include <ucontext.h>
#endif

#if defined(__SANITIZE_ADDRESS__)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif
#if defined(__SANITIZE_THREAD__)
#include <sanitizer/tsan_interface.h>
#endif

// The emulator's own bookkeeping (schedulers, warp exchanges, shared-memory tables) is shared by
// the emulated threads of a block by design; ThreadSanitizer must see only the kernel's accesses.
// Its functions are not instrumented (WORKBOOK_EMULATOR_INTERNAL), and where they call code that
// is (the standard library's containers and strings), an Unseen lives: while it does,
// ThreadSanitizer records none of this identity's loads and stores.
#if defined(__SANITIZE_THREAD__)
#define WORKBOOK_EMULATOR_INTERNAL __attribute__((no_sanitize_thread))
extern "C" void __tsan_ignore_thread_begin();
extern "C" void __tsan_ignore_thread_end();
#else
#define WORKBOOK_EMULATOR_INTERNAL
#endif

namespace workbook::emulate {

#if defined(WORKBOOK_EMULATE_FIBERS_BOOST)
inline constexpr const char* kFiberMechanism = "Boost.Context fcontext";
#else
inline constexpr const char* kFiberMechanism = "ucontext";
#endif

class Unseen {
 public:
  Unseen() {
#if defined(__SANITIZE_THREAD__)
    __tsan_ignore_thread_begin();
#endif
  }
  ~Unseen() {
#if defined(__SANITIZE_THREAD__)
    __tsan_ignore_thread_end();
#endif
  }
  Unseen(const Unseen&) = delete;
  Unseen& operator=(const Unseen&) = delete;
};

[[noreturn]] inline void fatal(const std::string& what) {
  std::fprintf(stderr, "[emulate] fatal: %s\n", what.c_str());
  std::abort();
}

// One fiber's stack: `usable` bytes above a guard page that no access may touch. The size is
// WORKBOOK_EMULATE_STACK_KB (256 by default; the sanitizers' builds use more stack per frame),
// reserved, not committed: a stack costs the memory its deepest call touches.
class Stack {
 public:
  Stack() {
    page_ = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
    usable_ = (requested_size() + page_ - 1) / page_ * page_;
    void* base = mmap(nullptr, usable_ + page_, PROT_READ | PROT_WRITE,
                      MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (base == MAP_FAILED) fatal("no memory for an emulated thread's stack");
    if (mprotect(base, page_, PROT_NONE) != 0) fatal("cannot protect a stack's guard page");
    base_ = static_cast<char*>(base);
  }
  ~Stack() { munmap(base_, usable_ + page_); }
  Stack(const Stack&) = delete;
  Stack& operator=(const Stack&) = delete;

  WORKBOOK_EMULATOR_INTERNAL char* bottom() const { return base_ + page_; }  // lowest usable byte
  WORKBOOK_EMULATOR_INTERNAL char* top() const { return base_ + page_ + usable_; }
  WORKBOOK_EMULATOR_INTERNAL std::size_t size() const { return usable_; }

  // After a fiber was abandoned in the middle of its kernel (a block that failed synccheck),
  // AddressSanitizer still holds the poison of its live frames: clear it before the stack is
  // used again.
  void forget_frames() {
#if defined(__SANITIZE_ADDRESS__)
    __asan_unpoison_memory_region(bottom(), usable_);
#endif
  }

  static std::size_t requested_size() {
    static const std::size_t bytes = [] {
      const char* kb = std::getenv("WORKBOOK_EMULATE_STACK_KB");
      const long value = kb != nullptr ? std::strtol(kb, nullptr, 10) : 0;
      return static_cast<std::size_t>(value > 0 ? value : 256) * 1024;
    }();
    return bytes;
  }

 private:
  char* base_ = nullptr;
  std::size_t page_ = 0, usable_ = 0;
};

// Who ThreadSanitizer thinks is running: a fiber of its own for each emulated thread under make
// racecheck (created once and reused: creating one costs ThreadSanitizer most of a millisecond),
// nothing otherwise.
class Identity {
 public:
  Identity() = default;
  ~Identity() { reset(); }
  Identity(const Identity&) = delete;
  Identity& operator=(const Identity&) = delete;

  void* get() {
#if defined(__SANITIZE_THREAD__)
    if (fiber_ == nullptr) fiber_ = __tsan_create_fiber(0);
#endif
    return fiber_;
  }
  // Forget the history of an identity abandoned in the middle of a kernel (its call stack, as
  // ThreadSanitizer records it, would otherwise never unwind).
  void reset() {
#if defined(__SANITIZE_THREAD__)
    if (fiber_ != nullptr) __tsan_destroy_fiber(fiber_);
#endif
    fiber_ = nullptr;
  }

 private:
  void* fiber_ = nullptr;
};

// The identity of the code that launched the kernel (a CPU thread), to switch back to.
WORKBOOK_EMULATOR_INTERNAL inline void* current_identity() {
#if defined(__SANITIZE_THREAD__)
  return __tsan_get_current_fiber();
#else
  return nullptr;
#endif
}

// Tell ThreadSanitizer who runs from the next instruction on. The flag 1 says the switch itself
// does not order memory: only the emulated barriers do (an emulated thread that is switched out
// and in again must not look synchronised with the others).
WORKBOOK_EMULATOR_INTERNAL inline void switch_identity([[maybe_unused]] void* to) {
#if defined(__SANITIZE_THREAD__)
  __tsan_switch_to_fiber(to, 1);
#endif
}

// happens-before, as ThreadSanitizer records it: everything before a release on `object` is
// ordered before everything after a later acquire of it.
WORKBOOK_EMULATOR_INTERNAL inline void release([[maybe_unused]] void* object) {
#if defined(__SANITIZE_THREAD__)
  __tsan_release(object);
#endif
}
WORKBOOK_EMULATOR_INTERNAL inline void acquire([[maybe_unused]] void* object) {
#if defined(__SANITIZE_THREAD__)
  __tsan_acquire(object);
#endif
}

// A fiber: `entry(argument)` on `stack`, entered by resume() from the scheduler, which it leaves
// by suspend() (to be resumed later) or, once entry has returned, for good. Only the scheduler
// resumes; a fiber only suspends.
class Fiber {
 public:
  using Entry = void (*)(void*);

  // The next resume() starts entry(argument) from the top of `stack`, as `identity`.
  WORKBOOK_EMULATOR_INTERNAL void start(Stack* stack, void* identity, Entry entry, void* argument) {
    stack_ = stack;
    identity_ = identity;
    entry_ = entry;
    argument_ = argument;
    finished_ = false;
#if defined(WORKBOOK_EMULATE_FIBERS_BOOST)
    context_ = boost::context::detail::make_fcontext(stack->top(), stack->size(), &trampoline);
#else
    getcontext(&context_);
    context_.uc_stack.ss_sp = stack->bottom();
    context_.uc_stack.ss_size = stack->size();
    context_.uc_link = nullptr;
    makecontext(&context_, &ucontext_trampoline, 0);
    begun_ = false;
#endif
  }

  // Run the fiber until it suspends or finishes (on the scheduler's stack).
  WORKBOOK_EMULATOR_INTERNAL void resume() {
    scheduler_identity_ = current_identity();
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(&scheduler_fake_stack_, stack_->bottom(), stack_->size());
#endif
    switch_identity(identity_);
#if defined(WORKBOOK_EMULATE_FIBERS_BOOST)
    context_ = boost::context::detail::jump_fcontext(context_, this).fctx;
#else
    if (!begun_) {
      starting = this;
      begun_ = true;
    }
    swapcontext(&scheduler_, &context_);
#endif
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(scheduler_fake_stack_, nullptr, nullptr);
#endif
  }

  // Back to the scheduler, until the next resume() (on the fiber's stack).
  WORKBOOK_EMULATOR_INTERNAL void suspend() {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(&fake_stack_, scheduler_bottom_, scheduler_size_);
#endif
    switch_identity(scheduler_identity_);
#if defined(WORKBOOK_EMULATE_FIBERS_BOOST)
    scheduler_ = boost::context::detail::jump_fcontext(scheduler_, nullptr).fctx;
#else
    swapcontext(&context_, &scheduler_);
#endif
    arrived();
  }

  WORKBOOK_EMULATOR_INTERNAL bool finished() const { return finished_; }

 private:
  // What every switch into the fiber ends with: AddressSanitizer learns the scheduler's stack.
  WORKBOOK_EMULATOR_INTERNAL void arrived() {
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_finish_switch_fiber(fake_stack_, &scheduler_bottom_, &scheduler_size_);
#endif
  }

  // The fiber's first frame: runs entry, then leaves for good (null: its fake stack is freed).
  WORKBOOK_EMULATOR_INTERNAL void run() {
    arrived();
    entry_(argument_);
    finished_ = true;
#if defined(__SANITIZE_ADDRESS__)
    __sanitizer_start_switch_fiber(nullptr, scheduler_bottom_, scheduler_size_);
#endif
    switch_identity(scheduler_identity_);
#if defined(WORKBOOK_EMULATE_FIBERS_BOOST)
    boost::context::detail::jump_fcontext(scheduler_, nullptr);
#else
    setcontext(&scheduler_);
#endif
    fatal("a finished fiber was resumed");
  }

#if defined(WORKBOOK_EMULATE_FIBERS_BOOST)
  WORKBOOK_EMULATOR_INTERNAL static void trampoline(boost::context::detail::transfer_t from) {
    auto* self = static_cast<Fiber*>(from.data);
    self->scheduler_ = from.fctx;
    self->run();
  }
  boost::context::detail::fcontext_t context_ = nullptr, scheduler_ = nullptr;
#else
  // makecontext passes int arguments only: the fiber being entered for the first time waits here.
  static inline thread_local Fiber* starting = nullptr;
  WORKBOOK_EMULATOR_INTERNAL static void ucontext_trampoline() { starting->run(); }
  ucontext_t context_{}, scheduler_{};
  bool begun_ = false;
#endif

  Stack* stack_ = nullptr;
  void* identity_ = nullptr;
  void* scheduler_identity_ = nullptr;
  Entry entry_ = nullptr;
  void* argument_ = nullptr;
  bool finished_ = true;
  // AddressSanitizer's state of each side while the other runs.
  void* fake_stack_ = nullptr;
  void* scheduler_fake_stack_ = nullptr;
  const void* scheduler_bottom_ = nullptr;
  std::size_t scheduler_size_ = 0;
};

}  // namespace workbook::emulate
