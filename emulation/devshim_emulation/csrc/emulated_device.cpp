// devshim's emulated accelerator: PyTorch's PrivateUse1 device backed by host memory.
//
// Built by torch.utils.cpp_extension only when emulation is requested (devshim_core/emulation/build.py).
// It gives the renamed PrivateUse1 device (`npu`, `tpu`, ...) what a vendor runtime gives it: several
// indexed devices with a thread-local current index, a DeviceAllocator with per-device statistics, a
// pinned host allocator, streams and timed events, per-device generators, autocast, and the structural
// kernels; every other op runs on the CPU kernels through a boxed fallback that first refuses operands
// the real device would refuse (a CPU tensor, or a tensor on another device index).
//
// Kernels run when they are called. Copies issued on a side stream are the exception: they are queued on that
// stream and land only when the stream is synchronized with (an event of it waited on or synchronized,
// wait_stream, stream or device synchronize) or runs further work, so a missing wait shows up as stale data,
// deterministically, where real hardware would race.

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/EmptyTensor.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/CachingHostAllocator.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/CPUFallback.h>
#include <ATen/native/Resize.h>
#include <ATen/ops/as_strided_cpu_dispatch.h>
#include <ATen/ops/set_cpu_dispatch.h>
#include <c10/core/CachingDeviceAllocator.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <array>
#include <functional>
#include <map>
#include <string>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace devshim_emulation {

using c10::DeviceIndex;
using c10::DeviceType;
using c10::StreamId;

constexpr DeviceIndex kMaxDevices = 64;
constexpr size_t kAlignment = 64;

std::atomic<int> g_device_count{1};
std::atomic<int64_t> g_memory_per_device{int64_t{32} << 30};  // reported capacity, not a reservation
std::atomic<uint64_t> g_fallback_calls{0};
thread_local DeviceIndex t_current_device = 0;

DeviceIndex device_count() { return static_cast<DeviceIndex>(g_device_count.load()); }

void check_index(DeviceIndex index) {
  TORCH_CHECK(index >= 0 && index < device_count(), "invalid device index ", static_cast<int>(index),
              ": the emulated device has ", static_cast<int>(device_count()), " devices");
}

DeviceIndex current_device() { return t_current_device; }

void set_device(DeviceIndex index) {
  check_index(index);
  t_current_device = index;
}

// -- device memory --------------------------------------------------------------------------------

class DeviceMemory final : public c10::DeviceAllocator {
 public:
  at::DataPtr allocate(size_t nbytes) override {
    const DeviceIndex device = current_device();
    void* data = nullptr;
    if (nbytes > 0) {
      const size_t rounded = (nbytes + kAlignment - 1) / kAlignment * kAlignment;
      data = std::aligned_alloc(kAlignment, rounded);
      TORCH_CHECK(data != nullptr, "emulated device ", static_cast<int>(device), ": out of host memory allocating ",
                  nbytes, " bytes");
      std::lock_guard<std::mutex> lock(mutex_);
      blocks_[data] = {nbytes, device};
      auto& stats = stats_[device];
      for (auto* array : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                          &stats.requested_bytes}) {
        (*array)[0].increase(nbytes);
      }
      stats.allocation[0].increase(1);
      stats.segment[0].increase(1);
      stats.active[0].increase(1);
      stats.num_device_alloc++;
    }
    return {data, data, &DeviceMemory::release, c10::Device(DeviceType::PrivateUse1, device)};
  }

  static void release(void* data);

  void forget(void* data) {
    if (data == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      auto it = blocks_.find(data);
      if (it != blocks_.end()) {
        auto& stats = stats_[it->second.device];
        const size_t nbytes = it->second.nbytes;
        for (auto* array : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes,
                            &stats.requested_bytes}) {
          (*array)[0].decrease(nbytes);
        }
        stats.allocation[0].decrease(1);
        stats.segment[0].decrease(1);
        stats.active[0].decrease(1);
        stats.num_device_free++;
        blocks_.erase(it);
      }
    }
    std::free(data);
  }

  at::DeleterFnPtr raw_deleter() const override { return &DeviceMemory::release; }

  void copy_data(void* dest, const void* src, std::size_t count) const final { std::memcpy(dest, src, count); }

  bool initialized() override { return true; }
  void emptyCache(c10::MempoolId_t) override {}  // nothing is cached: freed blocks go straight back
  void recordStream(const at::DataPtr&, c10::Stream) override {}  // synchronous: no use outlives its call

  c10::CachingDeviceAllocator::DeviceStats getDeviceStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    return stats_[device];
  }

  void resetAccumulatedStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& stats = stats_[device];
    for (auto* array : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes, &stats.requested_bytes,
                        &stats.allocation, &stats.segment, &stats.active}) {
      (*array)[0].reset_accumulated();
    }
    stats.num_device_alloc = stats.num_device_free = 0;
  }

  void resetPeakStats(DeviceIndex device) override {
    check_index(device);
    std::lock_guard<std::mutex> lock(mutex_);
    auto& stats = stats_[device];
    for (auto* array : {&stats.allocated_bytes, &stats.reserved_bytes, &stats.active_bytes, &stats.requested_bytes,
                        &stats.allocation, &stats.segment, &stats.active}) {
      (*array)[0].reset_peak();
    }
  }

  std::pair<size_t, size_t> getMemoryInfo(DeviceIndex device) override {
    check_index(device);
    const auto total = static_cast<size_t>(g_memory_per_device.load());
    std::lock_guard<std::mutex> lock(mutex_);
    const auto used = static_cast<size_t>(stats_[device].reserved_bytes[0].current);
    return {used < total ? total - used : 0, total};
  }

  // which device a pointer inside a live block belongs to (exact block starts only: enough for storages)
  std::optional<DeviceIndex> device_of(const void* data) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = blocks_.find(const_cast<void*>(data));
    if (it == blocks_.end()) return std::nullopt;
    return it->second.device;
  }

 private:
  struct Block {
    size_t nbytes;
    DeviceIndex device;
  };
  std::mutex mutex_;
  std::unordered_map<void*, Block> blocks_;
  std::array<c10::CachingDeviceAllocator::DeviceStats, kMaxDevices> stats_{};
};

DeviceMemory g_device_memory;
void DeviceMemory::release(void* data) { g_device_memory.forget(data); }
REGISTER_ALLOCATOR(DeviceType::PrivateUse1, &g_device_memory);

// -- pinned host memory ---------------------------------------------------------------------------

class PinnedMemory final : public at::HostAllocator {
 public:
  at::DataPtr allocate(size_t nbytes) override {
    void* data = nullptr;
    if (nbytes > 0) {
      data = std::aligned_alloc(kAlignment, (nbytes + kAlignment - 1) / kAlignment * kAlignment);
      TORCH_CHECK(data != nullptr, "out of host memory pinning ", nbytes, " bytes");
      std::lock_guard<std::mutex> lock(mutex_);
      pinned_.insert(data);
      current_ += static_cast<int64_t>(nbytes);
      sizes_[data] = nbytes;
      allocations_++;
    }
    return {data, data, &PinnedMemory::release, c10::Device(DeviceType::CPU)};
  }

  static void release(void* data);

  void forget(void* data) {
    if (data == nullptr) return;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      pinned_.erase(data);
      auto it = sizes_.find(data);
      if (it != sizes_.end()) {
        current_ -= static_cast<int64_t>(it->second);
        sizes_.erase(it);
      }
    }
    std::free(data);
  }

  bool is_pinned(const void* data) {
    std::lock_guard<std::mutex> lock(mutex_);
    return pinned_.count(const_cast<void*>(data)) > 0;
  }

  int64_t pinned_bytes() {
    std::lock_guard<std::mutex> lock(mutex_);
    return current_;
  }

  at::DeleterFnPtr raw_deleter() const override { return &PinnedMemory::release; }
  void copy_data(void* dest, const void* src, std::size_t count) const final { std::memcpy(dest, src, count); }
  bool record_event(void*, void*, c10::Stream) override { return true; }
  void empty_cache() override {}
  at::HostStats get_stats() override {
    at::HostStats stats;
    std::lock_guard<std::mutex> lock(mutex_);
    stats.allocations.current = static_cast<int64_t>(sizes_.size());
    stats.allocated_bytes.current = current_;
    stats.num_host_alloc = allocations_;
    return stats;
  }
  void reset_accumulated_stats() override {}
  void reset_peak_stats() override {}

 private:
  std::mutex mutex_;
  std::unordered_set<void*> pinned_;
  std::unordered_map<void*, size_t> sizes_;
  int64_t current_ = 0;
  int64_t allocations_ = 0;
};

PinnedMemory g_pinned_memory;
void PinnedMemory::release(void* data) { g_pinned_memory.forget(data); }
REGISTER_HOST_ALLOCATOR(DeviceType::PrivateUse1, &g_pinned_memory);

// -- generators -----------------------------------------------------------------------------------
// The CPU kernels the fallback runs accept only CPU generators, so each device's generator is a CPU
// generator of its own: seeded and saved per device index, independent of the host's default generator.

std::vector<at::Generator>& default_generators() {
  static std::vector<at::Generator> generators = [] {
    std::vector<at::Generator> made;
    for (int i = 0; i < kMaxDevices; ++i) {
      made.push_back(at::make_generator<at::CPUGeneratorImpl>(c10::detail::getNonDeterministicRandom()));
    }
    return made;
  }();
  return generators;
}

const at::Generator& default_generator(DeviceIndex index) {
  if (index < 0) index = current_device();
  check_index(index);
  return default_generators()[index];
}

// -- streams and events ---------------------------------------------------------------------------

constexpr int kPoolSize = 32;
thread_local std::array<StreamId, kMaxDevices> t_current_stream{};
std::atomic<uint32_t> g_pool_cursor{0};
std::atomic<StreamId> g_next_stream{kPoolSize + 1};

struct Event {
  std::chrono::steady_clock::time_point when;
  bool recorded = false;
  bool timed = false;  // created with enable_timing=True (torch passes BACKEND_DEFAULT for that)
  DeviceIndex device = 0;
  StreamId stream = 0;
};

// the side streams' queued copies (defined with the copy kernel below)
void flush_stream(DeviceIndex device, StreamId stream);
void flush_device(DeviceIndex device);
bool stream_idle(DeviceIndex device, StreamId stream);
void flush_current_stream(DeviceIndex device);

struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  static constexpr DeviceType static_type = DeviceType::PrivateUse1;

  DeviceType type() const override { return DeviceType::PrivateUse1; }

  c10::Device exchangeDevice(c10::Device device) const override {
    TORCH_INTERNAL_ASSERT(device.is_privateuseone());
    const auto old = current_device();
    if (device.index() != old) set_device(device.index());
    return c10::Device(DeviceType::PrivateUse1, old);
  }
  c10::Device getDevice() const override { return c10::Device(DeviceType::PrivateUse1, current_device()); }
  void setDevice(c10::Device device) const override { set_device(device.index()); }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.index() >= 0 && device.index() < device_count()) t_current_device = device.index();
  }

  c10::Stream make(DeviceIndex index, StreamId id) const {
    return c10::Stream(c10::Stream::UNSAFE, c10::Device(DeviceType::PrivateUse1, index), id);
  }
  c10::Stream getStream(c10::Device device) const override {
    const auto index = device.has_index() ? device.index() : current_device();
    return make(index, t_current_stream[index]);
  }
  c10::Stream getDefaultStream(c10::Device device) const override {
    return make(device.has_index() ? device.index() : current_device(), 0);
  }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool) const override {
    return make(device.has_index() ? device.index() : current_device(), 1 + (g_pool_cursor++ % kPoolSize));
  }
  c10::Stream getNewStream(c10::Device device, int) const override {
    return make(device.has_index() ? device.index() : current_device(), g_next_stream++);
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    const auto index = stream.device_index();
    const auto old = make(index, t_current_stream[index]);
    t_current_stream[index] = stream.id();
    return old;
  }
  DeviceIndex deviceCount() const noexcept override { return device_count(); }

  void record(void** event, const c10::Stream& stream, const DeviceIndex, const c10::EventFlag flag) const override {
    if (*event == nullptr) {
      *event = new Event();
      static_cast<Event*>(*event)->timed = flag == c10::EventFlag::BACKEND_DEFAULT;
    }
    auto* e = static_cast<Event*>(*event);
    e->when = std::chrono::steady_clock::now();
    e->recorded = true;
    e->device = stream.device_index();
    e->stream = stream.id();
  }
  // waiting on an event publishes what its stream queued before it (wait_stream records and waits one)
  void block(void* event, const c10::Stream&) const override {
    auto* e = static_cast<Event*>(event);
    if (e != nullptr && e->recorded) flush_stream(e->device, e->stream);
  }
  bool queryEvent(void* event) const override {
    auto* e = static_cast<Event*>(event);
    return e == nullptr || !e->recorded || stream_idle(e->device, e->stream);
  }
  void destroyEvent(void* event, const DeviceIndex) const noexcept override { delete static_cast<Event*>(event); }
  void synchronizeEvent(void* event) const override { block(event, c10::Stream(c10::Stream::DEFAULT, getDevice())); }
  bool queryStream(const c10::Stream& stream) const override { return stream_idle(stream.device_index(), stream.id()); }
  void synchronizeStream(const c10::Stream& stream) const override { flush_stream(stream.device_index(), stream.id()); }
  void synchronizeDevice(const DeviceIndex device) const override { flush_device(device < 0 ? current_device() : device); }
  void recordDataPtrOnStream(const c10::DataPtr&, const c10::Stream&) const override {}
  double elapsedTime(void* start, void* end, const DeviceIndex) const override {
    auto* a = static_cast<Event*>(start);
    auto* b = static_cast<Event*>(end);
    TORCH_CHECK(a != nullptr && b != nullptr && a->recorded && b->recorded,
                "both events must be recorded before elapsed_time() is asked");
    TORCH_CHECK(a->timed && b->timed, "Both events must be created with argument 'enable_timing=True'.");
    return std::chrono::duration<double, std::milli>(b->when - a->when).count();
  }
  c10::DeviceCapability getDeviceCapability(c10::Device) const override { return c10::DeviceCapability(); }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, GuardImpl);

// -- hooks ----------------------------------------------------------------------------------------

struct Hooks final : public at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return device_count() > 0; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  void init() const override {}
  DeviceIndex deviceCount() const override { return device_count(); }
  void setCurrentDevice(DeviceIndex device) const override { set_device(device); }
  DeviceIndex getCurrentDevice() const override { return current_device(); }
  DeviceIndex exchangeDevice(DeviceIndex device) const override {
    const auto old = current_device();
    set_device(device);
    return old;
  }
  DeviceIndex maybeExchangeDevice(DeviceIndex device) const override {
    if (device < 0 || device >= device_count()) return current_device();
    return exchangeDevice(device);
  }
  at::Allocator* getPinnedMemoryAllocator() const override { return &g_pinned_memory; }
  bool isPinnedPtr(const void* data) const override { return g_pinned_memory.is_pinned(data); }
  at::Device getDeviceFromPtr(void* data) const override {
    auto index = g_device_memory.device_of(data);
    TORCH_CHECK(index.has_value(), "the pointer was not allocated by the emulated device");
    return at::Device(DeviceType::PrivateUse1, *index);
  }
  const at::Generator& getDefaultGenerator(DeviceIndex index) const override { return default_generator(index); }
  at::Generator getNewGenerator(DeviceIndex) const override {
    return at::make_generator<at::CPUGeneratorImpl>(c10::detail::getNonDeterministicRandom());
  }
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t newsize) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    const DeviceIndex index = storage.device().index();
    const DeviceIndex previous = current_device();
    flush_current_stream(index);  // the bytes kept are what the current stream sees
    set_device(index);
    at::DataPtr fresh = g_device_memory.allocate(newsize);
    set_device(previous);
    const size_t keep = std::min(newsize, impl->nbytes());
    if (keep > 0) std::memcpy(fresh.get(), impl->data(), keep);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(newsize);
  }
};

int register_hooks() {
  static Hooks hooks;
  at::RegisterPrivateUse1HooksInterface(&hooks);
  return 0;
}
const int g_hooks_registered = register_hooks();

// -- structural kernels ---------------------------------------------------------------------------

at::Tensor host_alias(const at::Tensor& t) {
  return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), t.options().device(at::kCPU));
}

at::Tensor empty_memory_format(c10::IntArrayRef size, std::optional<c10::ScalarType> dtype,
                               std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                               std::optional<bool> pin_memory, std::optional<c10::MemoryFormat> memory_format) {
  const auto target = c10::device_or_default(device);
  TORCH_CHECK(target.is_privateuseone(), "expected an emulated-device tensor");
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "only strided tensors are supported");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "only CPU memory can be pinned");
  const c10::DeviceGuard guard(target);
  return at::detail::empty_generic(size, &g_device_memory, c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                   c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
                         std::optional<c10::Layout> layout, std::optional<c10::Device> device,
                         std::optional<bool> pin_memory) {
  const auto target = c10::device_or_default(device);
  TORCH_CHECK(target.is_privateuseone(), "expected an emulated-device tensor");
  TORCH_CHECK(c10::layout_or_default(layout) == c10::Layout::Strided, "only strided tensors are supported");
  TORCH_CHECK(!c10::pinned_memory_or_default(pin_memory), "only CPU memory can be pinned");
  const c10::DeviceGuard guard(target);
  return at::detail::empty_strided_generic(size, stride, &g_device_memory,
                                           c10::DispatchKeySet(c10::DispatchKey::PrivateUse1),
                                           c10::dtype_or_default(dtype));
}

at::Tensor as_strided(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride,
                      std::optional<c10::SymInt> offset) {
  return at::cpu::as_strided_symint(self, size, stride, std::move(offset));
}

const at::Tensor& resize_(const at::Tensor& self, c10::SymIntArrayRef size,
                          std::optional<at::MemoryFormat> memory_format) {
  return at::native::resize_(self, C10_AS_INTARRAYREF_SLOW(size), memory_format);
}

at::Tensor reshape_alias(const at::Tensor& self, c10::SymIntArrayRef size, c10::SymIntArrayRef stride) {
  return at::native::_reshape_alias(self, C10_AS_INTARRAYREF_SLOW(size), C10_AS_INTARRAYREF_SLOW(stride));
}

// -- side-stream copies ----------------------------------------------------------------------------

std::mutex g_pending_mutex;
std::map<std::pair<DeviceIndex, StreamId>, std::vector<std::function<void()>>> g_pending;
std::atomic<int64_t> g_pending_count{0};

std::vector<std::function<void()>> take(DeviceIndex device, StreamId stream) {
  std::lock_guard<std::mutex> lock(g_pending_mutex);
  auto it = g_pending.find({device, stream});
  if (it == g_pending.end()) return {};
  auto work = std::move(it->second);
  g_pending.erase(it);
  g_pending_count -= static_cast<int64_t>(work.size());
  return work;
}

void flush_stream(DeviceIndex device, StreamId stream) {
  if (g_pending_count.load() == 0) return;
  for (auto& copy : take(device, stream)) copy();
}

void flush_device(DeviceIndex device) {
  if (g_pending_count.load() == 0) return;
  std::vector<StreamId> streams;
  {
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    for (const auto& [key, work] : g_pending) {
      if (key.first == device) streams.push_back(key.second);
    }
  }
  for (auto stream : streams) flush_stream(device, stream);
}

bool stream_idle(DeviceIndex device, StreamId stream) {
  if (g_pending_count.load() == 0) return true;
  std::lock_guard<std::mutex> lock(g_pending_mutex);
  return g_pending.find({device, stream}) == g_pending.end();
}

// work on a stream runs after what that stream queued before it
void flush_current_stream(DeviceIndex device) {
  if (g_pending_count.load() != 0) flush_stream(device, t_current_stream[device]);
}

// set while a kernel runs on the CPU through the fallback: its own copies in and out are part of the kernel
thread_local bool t_in_kernel = false;

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  const DeviceIndex device = dst.is_privateuseone() ? dst.device().index() : self.device().index();
  const StreamId stream = t_current_stream[device];
  if (!t_in_kernel) flush_current_stream(device);
  const at::Tensor src_host = self.is_cpu() ? self : host_alias(self);
  at::Tensor dst_host = dst.is_cpu() ? dst : host_alias(dst);
  if (stream == 0 || t_in_kernel) {
    at::native::copy_(dst_host, src_host, non_blocking);
    return dst;
  }
  // on a side stream the source is read now and the destination written when the stream is waited on
  at::Tensor source = src_host.clone();
  at::Tensor keep_dst = dst;  // the destination's memory stays alive until the copy lands
  {
    std::lock_guard<std::mutex> lock(g_pending_mutex);
    g_pending[{device, stream}].push_back([dst_host, source, keep_dst]() mutable {
      at::native::copy_(dst_host, source, false);
    });
    g_pending_count++;
  }
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  at::native::resize_(dst, self.sizes(), std::nullopt);
  return copy_from(self, dst, false);
}

at::Scalar local_scalar_dense(const at::Tensor& self) {
  flush_current_stream(self.device().index());  // .item() reads after the current stream's queued work
  return at::native::_local_scalar_dense_cpu(host_alias(self));
}

at::Tensor& set_source_tensor(at::Tensor& self, const at::Tensor& source) {
  return at::native::set_tensor_(self, source);
}

at::Tensor& set_source_storage(at::Tensor& self, at::Storage source) { return at::native::set_(self, source); }

at::Tensor& set_source_storage_offset(at::Tensor& self, at::Storage storage, int64_t offset, c10::IntArrayRef size,
                                      c10::IntArrayRef stride) {
  return at::cpu::set_(self, storage, offset, size, stride);
}

at::Tensor view(const at::Tensor& self, c10::SymIntArrayRef size) {
  return at::native::view(self, C10_AS_INTARRAYREF_SLOW(size));
}

void record_stream(at::Tensor&, c10::Stream) {}  // synchronous device: nothing to keep alive

// As the vendor runtimes register it: a host tensor and a device tensor are both dense, so `param.data = moved`
// is allowed and Module.to/.cuda keep each Parameter object, with the attributes frameworks set on it (Megatron's
// tensor_model_parallel, sequence_parallel, allreduce). torch's default answers false for PrivateUse1, and the
// move would then build new Parameters without them.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  const auto dense = [](c10::DispatchKeySet keys) {
    return keys.has(c10::DispatchKey::CPU) || keys.has(c10::DispatchKey::PrivateUse1);
  };
  return self.key_set() == from.key_set() || (dense(self.key_set()) && dense(from.key_set()));
}

// -- the fallback: CPU kernels, after the checks the real device would make -------------------------

// ops whose index operands may stay on the host, as on CUDA
const std::unordered_set<std::string>& host_operand_ops() {
  static const std::unordered_set<std::string> ops = {"aten::index", "aten::index_put_", "aten::_index_put_impl_",
                                                      "aten::index_put"};
  return ops;
}

void check_operand(const at::Tensor& t, std::optional<c10::Device>& device, const c10::OperatorHandle& op) {
  if (!t.defined()) return;
  if (t.is_cpu()) {
    if (t.dim() == 0 || host_operand_ops().count(op.schema().name())) return;  // host scalars are fine, as on CUDA
    device = device.value_or(t.device());
  }
  if (!device.has_value()) {
    device = t.device();
  } else if (*device != t.device() && !(t.is_cpu() && device->is_cpu())) {
    auto name = [](const c10::Device& d) {
      return d.is_privateuseone() ? c10::get_privateuse1_backend() + ":" + std::to_string(d.index()) : d.str();
    };
    TORCH_CHECK(false, "Expected all tensors to be on the same device, but found at least two devices, ",
                name(*device), " and ", name(t.device()), "! (while running ", op.schema().name(),
                " on the emulated ", c10::get_privateuse1_backend(), " device)");
  }
}

void fallback(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  g_fallback_calls.fetch_add(1, std::memory_order_relaxed);
  flush_current_stream(current_device());
  const auto& schema = op.schema();
  const auto num_arguments = schema.arguments().size();
  std::optional<c10::Device> device;
  bool any_device_tensor = false;
  auto arguments = torch::jit::last(stack, num_arguments);
  for (const auto& ivalue : arguments) {
    if (ivalue.isTensor()) {
      any_device_tensor |= ivalue.toTensor().is_privateuseone();
    } else if (ivalue.isTensorList()) {
      for (const auto& t : ivalue.toTensorList()) any_device_tensor |= static_cast<at::Tensor>(t).is_privateuseone();
    }
  }
  if (any_device_tensor) {
    for (const auto& ivalue : arguments) {
      if (ivalue.isTensor()) {
        check_operand(ivalue.toTensor(), device, op);
      } else if (ivalue.isTensorList()) {
        for (const auto& t : ivalue.toTensorList()) check_operand(t, device, op);
      } else if (ivalue.isOptionalTensorList()) {
        for (const auto& t : ivalue.toOptionalTensorList()) {
          std::optional<at::Tensor> maybe = t;
          if (maybe.has_value()) check_operand(*maybe, device, op);
        }
      }
    }
  }
  // a random op given no generator draws from the current device's generator, not the host's
  for (size_t i = 0; i < num_arguments; ++i) {
    const auto& argument = schema.arguments()[i];
    auto& slot = (*stack)[stack->size() - num_arguments + i];
    if (slot.isNone() && argument.type()->kind() == c10::TypeKind::OptionalType &&
        argument.type()->containedType(0)->kind() == c10::TypeKind::GeneratorType && any_device_tensor) {
      const auto index = device.has_value() && device->is_privateuseone() ? device->index() : current_device();
      slot = c10::IValue(default_generator(index));
    }
  }
  t_in_kernel = true;
  try {
    at::native::cpu_fallback(op, stack);
  } catch (...) {
    t_in_kernel = false;
    throw;
  }
  t_in_kernel = false;
}

}  // namespace devshim_emulation

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  using namespace devshim_emulation;
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("as_strided", as_strided);
  m.impl("resize_", resize_);
  m.impl("_reshape_alias", reshape_alias);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_local_scalar_dense", local_scalar_dense);
  m.impl("set_.source_Tensor", set_source_tensor);
  m.impl("set_.source_Storage", set_source_storage);
  m.impl("set_.source_Storage_storage_offset", set_source_storage_offset);
  m.impl("view", view);
  m.impl("record_stream", record_stream);
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&devshim_emulation::fallback>());
}

// autocast: matmul-like ops run in the autocast dtype, losses and norms in fp32; the rest falls through
TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) { m.fallback(torch::CppFunction::makeFallthrough()); }

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
  KERNEL_PRIVATEUSEONE(mm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(bmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(addmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(baddbmm, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(matmul, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(linear, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(conv2d, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(scaled_dot_product_attention, lower_precision_fp)
  KERNEL_PRIVATEUSEONE(softmax, int, fp32)
  KERNEL_PRIVATEUSEONE(log_softmax, int, fp32)
  KERNEL_PRIVATEUSEONE(cross_entropy_loss, fp32)
  KERNEL_PRIVATEUSEONE(nll_loss, fp32)
  KERNEL_PRIVATEUSEONE(layer_norm, fp32)
  KERNEL_PRIVATEUSEONE(mse_loss, fp32)
}

// -- Python bindings ------------------------------------------------------------------------------

namespace devshim_emulation {

void configure(int count, int64_t memory_per_device) {
  TORCH_CHECK(count >= 1 && count <= kMaxDevices, "the emulated device count must be 1..", kMaxDevices, ", got ",
              count);
  g_device_count = count;
  g_memory_per_device = memory_per_device;
  if (t_current_device >= count) t_current_device = 0;
}

std::vector<int64_t> stream_of(DeviceIndex index) {
  if (index < 0) index = current_device();
  return {static_cast<int64_t>(index), static_cast<int64_t>(t_current_stream[index])};
}

}  // namespace devshim_emulation

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace devshim_emulation;
  m.def("configure", &configure, "set the device count and the capacity each device reports");
  m.def("device_count", [] { return static_cast<int>(device_count()); });
  m.def("current_device", [] { return static_cast<int>(current_device()); });
  m.def("set_device", [](int index) { set_device(static_cast<DeviceIndex>(index)); });
  m.def("default_generator", [](int index) { return default_generator(static_cast<DeviceIndex>(index)); });
  m.def("host_alias", [](const at::Tensor& t) {
    TORCH_CHECK(t.is_privateuseone(), "host_alias takes a tensor of the emulated device, got one on ", t.device());
    // a reader through the alias (a collective) is work on the current stream: it sees what that stream queued
    flush_current_stream(t.device().index());
    // the alias keeps the device storage alive for as long as the host view lives
    auto keep = t.storage();
    return at::from_blob(t.data_ptr(), t.sizes(), t.strides(), [keep](void*) {}, t.options().device(at::kCPU));
  }, "a CPU tensor sharing the device tensor's memory, after the current stream's queued copies have landed");
  m.def("synchronize", [](int index) { flush_device(static_cast<DeviceIndex>(index)); });
  m.def("pending_copies", [] { return g_pending_count.load(); });
  m.def("fallback_calls", [] { return g_fallback_calls.load(); });
  m.def("pinned_bytes", [] { return g_pinned_memory.pinned_bytes(); });
  m.def("memory_info", [](int index) { return g_device_memory.getMemoryInfo(static_cast<DeviceIndex>(index)); });
  m.def("memory_stats", [](int index) {
    const auto stats = g_device_memory.getDeviceStats(static_cast<DeviceIndex>(index));
    std::map<std::string, int64_t> out;
    const std::pair<const char*, const c10::CachingDeviceAllocator::StatArray*> arrays[] = {
        {"allocated_bytes", &stats.allocated_bytes}, {"reserved_bytes", &stats.reserved_bytes},
        {"active_bytes", &stats.active_bytes}, {"requested_bytes", &stats.requested_bytes},
        {"allocation", &stats.allocation}, {"segment", &stats.segment}, {"active", &stats.active}};
    for (const auto& [name, array] : arrays) {
      const auto& stat = (*array)[0];
      const std::string prefix = std::string(name) + ".all.";
      out[prefix + "current"] = stat.current;
      out[prefix + "peak"] = stat.peak;
      out[prefix + "allocated"] = stat.allocated;
      out[prefix + "freed"] = stat.freed;
    }
    out["num_device_alloc"] = stats.num_device_alloc;
    out["num_device_free"] = stats.num_device_free;
    return out;
  });
  m.def("reset_peak_stats", [](int index) { g_device_memory.resetPeakStats(static_cast<DeviceIndex>(index)); });
  m.def("reset_accumulated_stats",
        [](int index) { g_device_memory.resetAccumulatedStats(static_cast<DeviceIndex>(index)); });
}
