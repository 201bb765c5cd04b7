// Stage 06: autograd of the library's LLTM ops, in C++, on the Autograd dispatch key.
//
// Stage 05 registers the same formula from Python (torch.library.register_autograd). That is the
// simpler first lesson, and it costs time on every call: the dispatcher calls back into Python
// for the autograd layer, forward (save the tensors, mark what is not differentiable) and
// backward (unpack them, call the backward op). For a small op those microseconds are a large
// share: at the LLTM tutorial's size (batch 16, features 32, state 128, 2 threads) stage 05's ops
// alone take 38.5 us forward and 67.5 us backward, and through its Python autograd layer 62.2 and
// 149.4 us; the same ops through this file's C++ layer 37.6 and 116.7 us, of which ~55 us is the
// autograd engine's fixed cost per backward call (bench/results/lltm/cpu-2threads.md, "Where an
// LLTM step's microseconds go"; `make bench OP=lltm` measures it again). Registered here, on the
// Autograd key, the layer is a torch::autograd::Function: the same steps, without Python.
//
// What stays in Python (extops/lltm.py): the fake kernels, which torch.compile and meta tensors
// need, and the functional form. torch.compile traces through this kernel like through any
// autograd kernel: its forward calls the op below the autograd key, which on fake tensors runs
// the fake kernel.
//
// Sections: the ops below autograd, the Functions, registration.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <initializer_list>
#include <optional>
#include <tuple>

#include "workbook/checks.h"

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// ----------------------------------------------------------------------------------------------
// The ops, called through the dispatcher below the autograd key (the CPU, CUDA or fake kernel
// runs, whichever the inputs' device asks for).

std::tuple<at::Tensor, at::Tensor, at::Tensor> lltm_forward_op(const at::Tensor& input,
                                                               const at::Tensor& weights,
                                                               const at::Tensor& bias,
                                                               const at::Tensor& old_h,
                                                               const at::Tensor& old_cell) {
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow("extops::lltm_forward", "")
                             .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                                 const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const at::Tensor&, const at::Tensor&)>();
  return op.call(input, weights, bias, old_h, old_cell);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lltm_backward_op(
    const at::Tensor& grad_h, const at::Tensor& grad_cell, const at::Tensor& new_cell,
    const at::Tensor& gates, const at::Tensor& input, const at::Tensor& old_h,
    const at::Tensor& weights) {
  static const auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("extops::lltm_backward", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
              const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
              const at::Tensor&, const at::Tensor&, const at::Tensor&)>();
  return op.call(grad_h, grad_cell, new_cell, gates, input, old_h, weights);
}

// ----------------------------------------------------------------------------------------------
// The Functions

// forward's formula: save what the backward rebuilds the gates from, call the backward op.
class LLTMFunction : public torch::autograd::Function<LLTMFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const at::Tensor& input,
                               const at::Tensor& weights, const at::Tensor& bias,
                               const at::Tensor& old_h, const at::Tensor& old_cell) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [new_h, new_cell, gates] = lltm_forward_op(input, weights, bias, old_h, old_cell);
    ctx->save_for_backward({new_cell, gates, input, old_h, weights});
    // gates is an intermediate, returned for the backward's sake: no gradient flows into it.
    ctx->mark_non_differentiable({gates});
    // Unused outputs reach backward as undefined tensors, not zero-filled ones: for gates
    // (B x 3S) that is every call, so nothing is allocated and filled for it.
    ctx->set_materialize_grads(false);
    return {new_h, new_cell, gates};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const at::Tensor& new_cell = saved[0];
    const at::Tensor grad_h = grads[0].defined() ? grads[0] : at::zeros_like(new_cell);
    const at::Tensor grad_cell = grads[1].defined() ? grads[1] : at::zeros_like(new_cell);
    // Below the autograd key unless a graph of the backward is being recorded (create_graph):
    // then the backward op's own autograd kernel runs, and says it has no derivative.
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    auto [d_input, d_weights, d_bias, d_old_h, d_old_cell] =
        lltm_backward_op(grad_h, grad_cell, new_cell, saved[1], saved[2], saved[3], saved[4]);
    // In the inputs' order: input, weights, bias, old_h, old_cell.
    return {d_input, d_weights, d_bias, d_old_h, d_old_cell};
  }
};

// The backward op has no derivative: differentiating it (a gradient of a gradient) says so.
class LLTMBackwardFunction : public torch::autograd::Function<LLTMBackwardFunction> {
 public:
  static variable_list forward(AutogradContext* /*ctx*/, const at::Tensor& grad_h,
                               const at::Tensor& grad_cell, const at::Tensor& new_cell,
                               const at::Tensor& gates, const at::Tensor& input,
                               const at::Tensor& old_h, const at::Tensor& weights) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    auto [a, b, c, d, e] =
        lltm_backward_op(grad_h, grad_cell, new_cell, gates, input, old_h, weights);
    return {a, b, c, d, e};
  }

  static variable_list backward(AutogradContext* /*ctx*/, variable_list /*grads*/) {
    TORCH_CHECK(false,
                "lltm: double backward is not supported (the lltm backward op has no "
                "derivative); for second derivatives use a plain PyTorch LLTM");
  }
};

// What this layer refuses before anything runs, naming the argument or the op: a sparse or other
// non-dense input (below this key it would find no kernel for its backend, and the dispatcher's
// message names no argument), and forward-mode AD, which a torch::autograd::Function has no
// formula for (torch's own message names neither the op nor what to use instead).
void check_autograd_inputs(std::initializer_list<workbook::NamedTensor> args) {
  for (const auto& [t, arg] : args) workbook::check_strided(t, arg);
  for (const auto& [t, arg] : args) {
    TORCH_CHECK_NOT_IMPLEMENTED(!t._fw_grad(/*level=*/0).defined(), arg.op,
                                ": forward-mode AD (torch.autograd.forward_ad, torch.func.jvp, "
                                "jacfwd) is not supported: the op has a reverse-mode gradient "
                                "only; use torch.autograd.grad or Tensor.backward()");
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> lltm_forward_autograd(const at::Tensor& input,
                                                                     const at::Tensor& weights,
                                                                     const at::Tensor& bias,
                                                                     const at::Tensor& old_h,
                                                                     const at::Tensor& old_cell) {
  constexpr const char* kOp = "lltm";
  check_autograd_inputs({{input, {kOp, "input"}},
                         {weights, {kOp, "weights"}},
                         {bias, {kOp, "bias"}},
                         {old_h, {kOp, "old_h"}},
                         {old_cell, {kOp, "old_cell"}}});
  auto out = LLTMFunction::apply(input, weights, bias, old_h, old_cell);
  return {out[0], out[1], out[2]};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> lltm_backward_autograd(
    const at::Tensor& grad_h, const at::Tensor& grad_cell, const at::Tensor& new_cell,
    const at::Tensor& gates, const at::Tensor& input, const at::Tensor& old_h,
    const at::Tensor& weights) {
  auto out = LLTMBackwardFunction::apply(grad_h, grad_cell, new_cell, gates, input, old_h, weights);
  return {out[0], out[1], out[2], out[3], out[4]};
}

}  // namespace

// ----------------------------------------------------------------------------------------------
// Registration: the autograd layer of both ops, for every backend.

TORCH_LIBRARY_IMPL(extops, Autograd, m) {
  m.impl("lltm_forward", &lltm_forward_autograd);
  m.impl("lltm_backward", &lltm_backward_autograd);
}
