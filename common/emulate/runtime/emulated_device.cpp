// The emulated CUDA device as a PyTorch device: `emulated_cuda`, PyTorch's PrivateUse1 backend
// renamed (workbook/emulate.py names it and loads this library once per process).
//
// Its memory is host memory, so a kernel compiled by the host compiler (emulated_cuda.h) reads
// and writes it through the same data pointers a CUDA kernel would get. Tensors on it behave as
// CUDA tensors do where the kernels can tell: they are not CPU tensors (a kernel's device checks
// refuse a tensor left on the CPU), moving them takes .to(), and an op registered for the device
// (TORCH_LIBRARY_IMPL(ns, PrivateUse1, m), what the source pass makes of CUDA) is what they
// dispatch to. Every other ATen op (cat, addmm, sum, the tests' comparisons) runs through a
// fallback that computes it with the CPU kernel on the same memory, as a stand-in for the ATen
// CUDA kernels a GPU would run.
//
// Sections: memory, the ops every device must provide, matrix products, the fallback.
#include <ATen/ATen.h>
#include <ATen/EmptyTensor.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/_reshape_alias_native.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <ATen/ops/unfold_native.h>
#include <ATen/ops/view_native.h>
#include <c10/core/Allocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <c10/core/impl/alloc_cpu.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <initializer_list>

namespace {

constexpr c10::DeviceType kEmulated = c10::DeviceType::PrivateUse1;

// ----------------------------------------------------------------------------------------------
// Memory: c10's CPU allocation (posix_memalign), so AddressSanitizer guards every buffer and a
// kernel reading past one is reported at the load.

struct EmulatedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t bytes) override {
    void* data = bytes == 0 ? nullptr : c10::alloc_cpu(bytes);
    return {data, data, &c10::free_cpu, c10::Device(kEmulated, 0)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &c10::free_cpu; }
  void copy_data(void* dest, const void* src, std::size_t count) const override {
    std::memcpy(dest, src, count);
  }
};

EmulatedAllocator allocator;
REGISTER_ALLOCATOR(kEmulated, &allocator);

// One device and one stream, on which every launch has finished when it returns: device 0 is
// always current, and an event (the autograd engine records them between streams) is always
// complete.
struct EmulatedGuard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kEmulated; }
  c10::Device exchangeDevice(c10::Device) const override { return {kEmulated, 0}; }
  c10::Device getDevice() const override { return {kEmulated, 0}; }
  void setDevice(c10::Device device) const override {
    TORCH_CHECK(device.index() <= 0, "the emulated CUDA device is device 0 alone, got ", device);
  }
  void uncheckedSetDevice(c10::Device) const noexcept override {}
  c10::Stream getStream(c10::Device) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kEmulated, 0));
  }
  c10::Stream exchangeStream(c10::Stream) const override {
    return c10::Stream(c10::Stream::DEFAULT, c10::Device(kEmulated, 0));
  }
  c10::DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const c10::Stream&, const c10::DeviceIndex,
              const c10::EventFlag) const override {}
  void block(void*, const c10::Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const c10::DeviceIndex) const noexcept override {}
  bool queryStream(const c10::Stream&) const override { return true; }
  void synchronizeStream(const c10::Stream&) const override {}
  void synchronizeEvent(void*) const override {}
  void synchronizeDevice(const c10::DeviceIndex) const override {}
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, EmulatedGuard);

// What PyTorch asks of an accelerator (the autograd engine, the generators): always there, one
// device, random numbers drawn by the CPU's generator (the fallback computes them on the CPU).
struct EmulatedHooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  c10::DeviceIndex deviceCount() const override { return 1; }
  c10::DeviceIndex getCurrentDevice() const override { return 0; }
  const at::Generator& getDefaultGenerator(c10::DeviceIndex) const override {
    return at::detail::getDefaultCPUGenerator();
  }
  at::Device getDeviceFromPtr(void*) const override { return c10::Device(kEmulated, 0); }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t bytes) const override {
    c10::DataPtr fresh = allocator.allocate(bytes);
    const size_t kept = std::min(bytes, storage.nbytes());
    if (kept > 0) std::memcpy(fresh.get(), storage.data(), kept);
    storage.set_data_ptr_noswap(std::move(fresh));
    storage.set_nbytes(bytes);
  }
};

const bool hooks_registered = [] {
  at::RegisterPrivateUse1HooksInterface(new EmulatedHooks());
  return true;
}();

// A CPU tensor over the same memory (sizes, strides, storage offset), to compute on.
at::Tensor host_view(const at::Tensor& t) {
  if (t.device().type() == c10::DeviceType::CPU) return t;
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(c10::kCPU));
}

// ----------------------------------------------------------------------------------------------
// What every device provides itself: allocation, views, resizing and copies. (A view op is
// registered here when ATen dispatches it per backend; the rest are composites of as_strided.)

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory,
                               std::optional<c10::MemoryFormat> memory_format) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "the emulated CUDA device holds strided tensors only");
  return at::detail::empty_generic(size, &allocator,
                                   c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride,
                         std::optional<c10::ScalarType> dtype, std::optional<c10::Layout> layout,
                         std::optional<c10::Device> device, std::optional<bool> pin_memory) {
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided,
              "the emulated CUDA device holds strided tensors only");
  return at::detail::empty_strided_generic(size, stride, &allocator,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::IntArrayRef size, c10::IntArrayRef stride,
                      std::optional<int64_t> storage_offset) {
  return at::cpu::as_strided(self, size, stride, storage_offset);
}

const at::Tensor& resize_(const at::Tensor& self, c10::IntArrayRef size,
                          std::optional<c10::MemoryFormat> memory_format) {
  return at::native::resize_(self, size, memory_format);
}

at::Tensor& set_source_storage(at::Tensor& self, c10::Storage source) {
  return at::cpu::set_(self, source);
}

at::Tensor& set_source_storage_offset(at::Tensor& self, c10::Storage source,
                                      c10::SymInt storage_offset, c10::SymIntArrayRef size,
                                      c10::SymIntArrayRef stride) {
  return at::cpu::set__symint(self, source, storage_offset, size, stride);
}

// Host memory on both sides: a copy between the emulated device and the CPU, or within the
// device, is a CPU copy between views of the two buffers (any strides, any dtypes).
at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool /*non_blocking*/) {
  host_view(dst).copy_(host_view(self));
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

// Convolutions reach a backend outside ATen's own through these two (the tests compare the
// kernels with F.conv2d): the CPU's convolution on the same memory.
at::Tensor convolution_overrideable(const at::Tensor& input, const at::Tensor& weight,
                                    const std::optional<at::Tensor>& bias, c10::IntArrayRef stride,
                                    c10::IntArrayRef padding, c10::IntArrayRef dilation,
                                    bool transposed, c10::IntArrayRef output_padding,
                                    int64_t groups) {
  const std::optional<at::Tensor> host_bias = bias.has_value() && bias->defined()
                                                  ? std::optional<at::Tensor>(host_view(*bias))
                                                  : std::nullopt;
  return at::convolution(host_view(input), host_view(weight), host_bias, stride, padding, dilation,
                         transposed, output_padding, groups)
      .to(input.device());
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> convolution_backward_overrideable(
    const at::Tensor& grad_output, const at::Tensor& input, const at::Tensor& weight,
    c10::IntArrayRef stride, c10::IntArrayRef padding, c10::IntArrayRef dilation, bool transposed,
    c10::IntArrayRef output_padding, int64_t groups, std::array<bool, 3> output_mask) {
  const int64_t bias_size = weight.size(transposed ? 1 : 0) * (transposed ? groups : 1);
  auto [g_input, g_weight, g_bias] = at::convolution_backward(
      host_view(grad_output), host_view(input), host_view(weight), std::vector<int64_t>{bias_size},
      stride, padding, dilation, transposed, output_padding, groups, output_mask);
  const auto back = [&](const at::Tensor& t) { return t.defined() ? t.to(input.device()) : t; };
  return {back(g_input), back(g_weight), back(g_bias)};
}

// Matrix products (the LLTM's gates and gradients): the CPU's GEMM on the same memory, without
// the fallback's copies. In float16 and bfloat16 the CPU has no fast GEMM (the fallback's took 22
// of a 25 s test at 65536 rows): these multiply in float32 and round the result once, as cuBLAS
// does by default. Mixed dtypes go to ATen's own GEMM, which refuses them with its message.
bool in_float32(std::initializer_list<const at::Tensor*> tensors) {
  const auto dtype = (*tensors.begin())->scalar_type();
  return at::isReducedFloatingType(dtype) &&
         std::all_of(tensors.begin(), tensors.end(),
                     [&](const at::Tensor* t) { return t->scalar_type() == dtype; });
}

at::Tensor host_operand(const at::Tensor& t, bool widen) {
  return widen ? host_view(t).to(at::kFloat) : host_view(t);
}

at::Tensor mm(const at::Tensor& self, const at::Tensor& mat2) {
  const bool widen = in_float32({&self, &mat2});
  const auto out = at::mm(host_operand(self, widen), host_operand(mat2, widen));
  return out.to(self.device(), widen ? self.scalar_type() : out.scalar_type());
}

at::Tensor addmm(const at::Tensor& self, const at::Tensor& mat1, const at::Tensor& mat2,
                 const at::Scalar& beta, const at::Scalar& alpha) {
  const bool widen = in_float32({&self, &mat1, &mat2});
  const auto out = at::addmm(host_operand(self, widen), host_operand(mat1, widen),
                             host_operand(mat2, widen), beta, alpha);
  return out.to(mat1.device(), widen ? mat1.scalar_type() : out.scalar_type());
}

// ----------------------------------------------------------------------------------------------
// Everything else: the CPU kernel on the same values (ATen's cpu_fallback copies the device
// tensors to the CPU, runs the op, copies the results and mutated inputs back).

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  at::native::cpu_fallback(op, stack);
}

}  // namespace

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", &empty_memory_format);
  m.impl("empty_strided", &empty_strided);
  m.impl("as_strided", &as_strided);
  m.impl("resize_", &resize_);
  m.impl("set_.source_Storage", &set_source_storage);
  m.impl("set_.source_Storage_storage_offset", &set_source_storage_offset);
  m.impl("_copy_from", &copy_from);
  m.impl("_copy_from_and_resize", &copy_from_and_resize);
  m.impl("view", &at::native::view);
  m.impl("_reshape_alias", &at::native::_reshape_alias);
  m.impl("unfold", &at::native::unfold);
  m.impl("convolution_overrideable", &convolution_overrideable);
  m.impl("convolution_backward_overrideable", &convolution_backward_overrideable);
  m.impl("mm", &mm);
  m.impl("addmm", &addmm);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
}
