// Does the page size of the pinned pool set the miss copy's rate? A CUDA program of its own (no JAX).
//
//   nvcc -O3 -arch=sm_90 -o /tmp/host_row_gather benchmarks/probes/host_row_gather.cu
//   /tmp/host_row_gather [--pool_gb=40] [--rows=10240] [--row_bytes=656] [--sets=16] [--calls=40] \
//       [--kinds=hostalloc,thp,hugetlb] [--blocks=264,528,1056]            # one JSON object per line
//
// Why: the rank's copy moved fp8 rows at 23.7-30.9 GB/s from an 82 GB pool where the probes had
// seen ~45-50 GB/s from 1-10 GB pools (docs/PERFORMANCE.md, fourteenth session). If the GPU's
// address translation of the pool is what limits random 656-byte reads, a pool backed by 2 MB
// pages (fewer translations) reads faster; if not, the page size does not matter.
//
// Kinds of pinned memory, each --pool_gb large, filled with a pattern on the host:
//   hostalloc  cudaHostAlloc(Portable | Mapped): what XLA's pinned_host memory is;
//   thp        mmap + madvise(MADV_HUGEPAGE) (transparent huge pages), then cudaHostRegister;
//              "thp_kb" says how much of it the kernel backed with huge pages;
//   hugetlb    mmap(MAP_HUGETLB) of 2 MB pages, then cudaHostRegister (needs reserved huge
//              pages: "unavailable" with the reason when there are none).
// Per kind, a 1 GB pool of the same kind too ("small"): the reads within TLB reach.
// Each call gathers --rows random rows (uniform over the pool, 16-byte loads, a grid-stride loop
// over 16-byte units) into device memory; --sets row lists are taken in turn so that no list
// is in L2 when it is read again. Device time per call by CUDA events; median, p10, p90, GB/s
// of row bytes. Every gathered byte is checked on the device against the pattern
// (mismatches must be 0); exit 1 when any is not.

#include <cuda_runtime.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#ifndef MAP_HUGE_2MB
#define MAP_HUGE_2MB (21 << 26)
#endif

namespace {

struct Options {
  double pool_gb = 40.0;
  int64_t rows = 10240;  // DeepSeek-V3.2's 50 requests x ~205 misses a layer
  int64_t row_bytes = 656;
  int sets = 16;
  int calls = 40;
  std::vector<std::string> kinds = {"hostalloc", "thp", "hugetlb"};
  std::vector<int> blocks = {264, 528, 1056};
};

std::vector<std::string> Split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) out.push_back(item);
  return out;
}

bool Flag(const char* arg, const char* name, std::string* value) {
  const size_t n = std::strlen(name);
  if (std::strncmp(arg, name, n) != 0 || arg[n] != '=') return false;
  *value = arg + n + 1;
  return true;
}

// The pattern: 8-byte word w of the pool holds Mix(w).
__host__ __device__ inline uint64_t Mix(uint64_t w) {
  w = (w + 0x9E3779B97F4A7C15ull) * 0xBF58476D1CE4E5B9ull;
  return w ^ (w >> 31);
}

__global__ void GatherRows(const uint4* __restrict__ pool, const int64_t* __restrict__ src, uint4* __restrict__ out,
                           int64_t rows, int64_t units) {
  const int64_t total = rows * units;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / units;
    out[i] = pool[src[r] * units + (i - r * units)];
  }
}

__global__ void CountMismatches(const uint64_t* __restrict__ out, const int64_t* __restrict__ src, int64_t rows,
                                int64_t words, unsigned long long* mismatches) {
  const int64_t total = rows * words;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < total;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / words;
    if (out[i] != Mix(static_cast<uint64_t>(src[r] * words + (i - r * words)))) atomicAdd(mismatches, 1ull);
  }
}

void Fill(uint64_t* words, int64_t count) {  // the pattern, on all host cores
  const int threads = std::max(1u, std::min(32u, std::thread::hardware_concurrency()));
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([=] {
      const int64_t begin = count * t / threads, end = count * (t + 1) / threads;
      for (int64_t w = begin; w < end; ++w) words[w] = Mix(static_cast<uint64_t>(w));
    });
  }
  for (auto& th : pool) th.join();
}

int64_t HugePagesKb() {  // AnonHugePages of this process (transparent huge pages in use)
  std::ifstream in("/proc/self/smaps_rollup");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind("AnonHugePages:", 0) == 0) return std::atoll(line.c_str() + 14);
  }
  return -1;
}

std::string ReadFirstLine(const char* path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

struct Pool {
  char* host = nullptr;
  size_t bytes = 0;
  bool registered = false, mapped = false, hostalloc = false;
  std::string error;
  int64_t thp_kb = -1;
};

Pool Allocate(const std::string& kind, size_t bytes) {
  Pool p;
  p.bytes = bytes;
  if (kind == "hostalloc") {
    void* ptr = nullptr;
    cudaError_t e = cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable | cudaHostAllocMapped);
    if (e != cudaSuccess) {
      p.error = std::string("cudaHostAlloc: ") + cudaGetErrorString(e);
      return p;
    }
    p.host = static_cast<char*>(ptr);
    p.hostalloc = true;
  } else {
    int flags = MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE;
    if (kind == "hugetlb") flags |= MAP_HUGETLB | MAP_HUGE_2MB;
    void* ptr = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, flags, -1, 0);
    if (ptr == MAP_FAILED) {
      p.error = std::string("mmap: ") + std::strerror(errno);
      return p;
    }
    p.host = static_cast<char*>(ptr);
    p.mapped = true;
    if (kind == "thp" && madvise(ptr, bytes, MADV_HUGEPAGE) != 0) {
      p.error = std::string("madvise(MADV_HUGEPAGE): ") + std::strerror(errno);
      return p;
    }
  }
  Fill(reinterpret_cast<uint64_t*>(p.host), static_cast<int64_t>(bytes / 8));  // touches every page
  p.thp_kb = HugePagesKb();
  if (!p.hostalloc) {
    cudaError_t e = cudaHostRegister(p.host, bytes, cudaHostRegisterPortable | cudaHostRegisterMapped);
    if (e != cudaSuccess) {
      p.error = std::string("cudaHostRegister: ") + cudaGetErrorString(e);
      cudaGetLastError();
      return p;
    }
    p.registered = true;
  }
  return p;
}

void Free(Pool& p) {
  if (p.registered) cudaHostUnregister(p.host);
  if (p.hostalloc) cudaFreeHost(p.host);
  if (p.mapped) munmap(p.host, p.bytes);
  p = Pool();
}

double Percentile(std::vector<float> v, double q) {
  std::sort(v.begin(), v.end());
  return v[static_cast<size_t>(q * (v.size() - 1) + 0.5)];
}

// One pool: per grid size, `calls` timed gathers over `sets` rotating row lists, then the check.
bool Measure(const Options& o, const std::string& kind, const char* size_name, size_t bytes) {
  Pool p = Allocate(kind, bytes);
  std::printf("{\"kind\": \"%s\", \"pool\": \"%s\", \"pool_gb\": %.2f, \"thp_kb\": %lld", kind.c_str(), size_name,
              bytes / 1e9, static_cast<long long>(p.thp_kb));
  if (!p.error.empty()) {
    std::printf(", \"unavailable\": \"%s\"}\n", p.error.c_str());
    Free(p);
    return true;  // a kind this machine cannot make is a result, not a failure
  }
  const int64_t units = o.row_bytes / 16, pool_rows = static_cast<int64_t>(bytes / o.row_bytes);
  std::mt19937_64 rng(7);
  std::uniform_int_distribution<int64_t> pick(0, pool_rows - 1);
  std::vector<int64_t> src(static_cast<size_t>(o.sets * o.rows));
  for (auto& s : src) s = pick(rng);
  int64_t* d_src = nullptr;
  uint4* d_out = nullptr;
  unsigned long long* d_bad = nullptr;
  cudaMalloc(&d_src, src.size() * sizeof(int64_t));
  cudaMalloc(&d_out, static_cast<size_t>(o.rows * o.row_bytes));
  cudaMalloc(&d_bad, sizeof(unsigned long long));
  cudaMemcpy(d_src, src.data(), src.size() * sizeof(int64_t), cudaMemcpyHostToDevice);
  cudaMemset(d_bad, 0, sizeof(unsigned long long));
  uint4* d_pool = nullptr;
  cudaHostGetDevicePointer(reinterpret_cast<void**>(&d_pool), p.host, 0);
  cudaEvent_t begin, end;
  cudaEventCreate(&begin);
  cudaEventCreate(&end);
  bool ok = true;
  std::printf(", \"rows\": %lld, \"row_bytes\": %lld, \"grids\": [", static_cast<long long>(o.rows),
              static_cast<long long>(o.row_bytes));
  for (size_t g = 0; g < o.blocks.size(); ++g) {
    std::vector<float> us;
    for (int c = -o.sets; c < o.calls; ++c) {  // one pass over the sets first: warm, untimed
      const int64_t* list = d_src + static_cast<int64_t>((c + o.sets) % o.sets) * o.rows;
      cudaEventRecord(begin);
      GatherRows<<<o.blocks[g], 256>>>(d_pool, list, d_out, o.rows, units);
      cudaEventRecord(end);
      cudaEventSynchronize(end);
      float ms = 0;
      cudaEventElapsedTime(&ms, begin, end);
      if (c >= 0) us.push_back(ms * 1e3f);
      if (c == o.calls - 1) CountMismatches<<<264, 256>>>(reinterpret_cast<uint64_t*>(d_out), list, o.rows, o.row_bytes / 8, d_bad);
    }
    unsigned long long bad = 0;
    cudaMemcpy(&bad, d_bad, sizeof(bad), cudaMemcpyDeviceToHost);
    cudaMemset(d_bad, 0, sizeof(unsigned long long));
    cudaError_t e = cudaGetLastError();
    const double median = Percentile(us, 0.5);
    std::printf("%s{\"blocks\": %d, \"us\": %.2f, \"p10_us\": %.2f, \"p90_us\": %.2f, \"gb_per_s\": %.2f, \"mismatches\": %llu%s%s%s}",
                g ? ", " : "", o.blocks[g], median, Percentile(us, 0.1), Percentile(us, 0.9),
                o.rows * o.row_bytes / (median * 1e3), bad, e == cudaSuccess ? "" : ", \"error\": \"",
                e == cudaSuccess ? "" : cudaGetErrorString(e), e == cudaSuccess ? "" : "\"");
    ok = ok && bad == 0 && e == cudaSuccess;
  }
  std::printf("]}\n");
  std::fflush(stdout);
  cudaEventDestroy(begin);
  cudaEventDestroy(end);
  cudaFree(d_src);
  cudaFree(d_out);
  cudaFree(d_bad);
  Free(p);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    std::string v;
    if (Flag(argv[i], "--pool_gb", &v)) o.pool_gb = std::atof(v.c_str());
    else if (Flag(argv[i], "--rows", &v)) o.rows = std::atoll(v.c_str());
    else if (Flag(argv[i], "--row_bytes", &v)) o.row_bytes = std::atoll(v.c_str());
    else if (Flag(argv[i], "--sets", &v)) o.sets = std::atoi(v.c_str());
    else if (Flag(argv[i], "--calls", &v)) o.calls = std::atoi(v.c_str());
    else if (Flag(argv[i], "--kinds", &v)) o.kinds = Split(v);
    else if (Flag(argv[i], "--blocks", &v)) {
      o.blocks.clear();
      for (const auto& b : Split(v)) o.blocks.push_back(std::atoi(b.c_str()));
    } else {
      std::fprintf(stderr, "error: unknown argument %s\n", argv[i]);
      return 2;
    }
  }
  if (o.row_bytes % 16 || o.rows < 1 || o.sets < 1 || o.calls < 1 || o.pool_gb <= 0 || o.blocks.empty()) {
    std::fprintf(stderr, "error: --row_bytes must be a multiple of 16; --rows, --sets, --calls, --pool_gb positive\n");
    return 2;
  }
  int device_count = 0;
  if (cudaGetDeviceCount(&device_count) != cudaSuccess || device_count == 0) {
    std::fprintf(stderr, "error: no CUDA device\n");
    return 2;
  }
  std::printf("{\"thp_enabled\": \"%s\", \"thp_defrag\": \"%s\", \"nr_hugepages\": \"%s\"}\n",
              ReadFirstLine("/sys/kernel/mm/transparent_hugepage/enabled").c_str(),
              ReadFirstLine("/sys/kernel/mm/transparent_hugepage/defrag").c_str(),
              ReadFirstLine("/proc/sys/vm/nr_hugepages").c_str());
  bool ok = true;
  const size_t big = static_cast<size_t>(o.pool_gb * 1e9) / (2u << 20) * (2u << 20);  // whole 2 MB pages
  for (const auto& kind : o.kinds) {
    ok = Measure(o, kind, "small", 1u << 30) && ok;
    ok = Measure(o, kind, "large", big) && ok;
  }
  return ok ? 0 : 1;
}
