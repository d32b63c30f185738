// DeviceWait: an op that hands back its inputs after a given time, without holding a
// host thread or the GIL meanwhile: the benchmarks' model of an accelerator's kernel.
// An asynchronous kernel: Compute returns at once and a timer thread finishes the op.
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <thread>

#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/lib/core/threadpool.h"

namespace {

using Clock = std::chrono::steady_clock;

// One thread runs every pending op's end at its due time.
class Timer {
 public:
  static Timer& Get() {
    static Timer* timer = new Timer();  // never destroyed: ops may end during exit
    return *timer;
  }
  void At(Clock::time_point when, std::function<void()> fn) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      due_.emplace(when, std::move(fn));
    }
    cv_.notify_one();
  }

 private:
  Timer() { std::thread([this] { Run(); }).detach(); }
  void Run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      if (due_.empty()) {
        cv_.wait(lock);
        continue;
      }
      auto first = due_.begin();
      if (Clock::now() < first->first) {
        cv_.wait_until(lock, first->first);
        continue;
      }
      auto fn = std::move(first->second);
      due_.erase(first);
      lock.unlock();
      fn();
      lock.lock();
    }
  }
  std::mutex mu_;
  std::condition_variable cv_;
  std::multimap<Clock::time_point, std::function<void()>> due_;
};

}  // namespace

REGISTER_OP("DeviceWait")
    .Input("inputs: T")
    .Output("outputs: T")
    .Attr("T: list(type)")
    .Attr("micros: int >= 0")
    // Not stateful: a traced function would otherwise run every stateful op in program
    // order, and the ops that take each gradient as it appears would wait for the whole
    // backward pass. Every wait takes a tensor the step computes, so none is folded.
    .SetShapeFn([](tensorflow::shape_inference::InferenceContext* c) {
      for (int i = 0; i < c->num_inputs(); ++i) c->set_output(i, c->input(i));
      return tensorflow::OkStatus();
    });

class DeviceWaitOp : public tensorflow::AsyncOpKernel {
 public:
  explicit DeviceWaitOp(tensorflow::OpKernelConstruction* ctx) : AsyncOpKernel(ctx) {
    OP_REQUIRES_OK(ctx, ctx->GetAttr("micros", &micros_));
  }
  void ComputeAsync(tensorflow::OpKernelContext* ctx, DoneCallback done) override {
    auto when = Clock::now() + std::chrono::microseconds(micros_);
    auto* pool = ctx->device()->tensorflow_cpu_worker_threads()->workers;
    // The end runs on TensorFlow's own threads: what it makes ready never holds the timer.
    Timer::Get().At(when, [ctx, done, pool] {
      pool->Schedule([ctx, done] {
        for (int i = 0; i < ctx->num_inputs(); ++i) ctx->set_output(i, ctx->input(i));
        done();
      });
    });
  }

 private:
  tensorflow::int64 micros_;
};

REGISTER_KERNEL_BUILDER(Name("DeviceWait").Device(tensorflow::DEVICE_CPU), DeviceWaitOp);
