// GPU test of the device N:M pruning kernel: its values, indices and metadata words must equal the
// host dfss::nm_compress / dfss::nm_metadata_encode bit for bit (same shared selection headers).
// Without a CUDA device the binary prints the reason and exits 77 (CTest SKIP_RETURN_CODE).
// The TESTs sit outside the anonymous namespace: inside it nvcc 13 reports each one's registration
// member as unused (#177-D, an error under -Werror=all-warnings) whenever GoogleTest's headers are
// not system headers, e.g. when GoogleTest is built from source.
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cuda/nm_format_device.hpp"
#include "dfss/format.hpp"

namespace {

using dfss::meta_format;
using dfss::pattern;

// Owning device buffer; failures are reported through gtest by the caller via ok().
template <typename T>
class device_buffer {
 public:
  explicit device_buffer(std::size_t count) : count_(count) {
    if (count_ > 0) status_ = cudaMalloc(reinterpret_cast<void**>(&ptr_), count_ * sizeof(T));
  }
  device_buffer(const device_buffer&) = delete;
  device_buffer& operator=(const device_buffer&) = delete;
  ~device_buffer() {
    if (ptr_ != nullptr) cudaFree(ptr_);
  }
  T* get() const { return ptr_; }
  cudaError_t status() const { return status_; }

 private:
  std::size_t count_;
  T* ptr_ = nullptr;
  cudaError_t status_ = cudaSuccess;
};

::testing::AssertionResult cuda_ok(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return ::testing::AssertionSuccess();
  return ::testing::AssertionFailure()
         << what << ": " << cudaGetErrorName(e) << ": " << cudaGetErrorString(e);
}

std::vector<float> random_matrix(std::mt19937& rng, std::size_t size) {
  std::uniform_int_distribution<int> small(-4, 4);
  std::uniform_int_distribution<int> kind(0, 19);
  std::uniform_real_distribution<float> real(-3.0f, 3.0f);
  std::vector<float> v(size);
  for (auto& x : v) {
    const int k = kind(rng);
    x = k == 0   ? std::numeric_limits<float>::quiet_NaN()
        : k == 1 ? -std::numeric_limits<float>::infinity()
        : k < 8  ? static_cast<float>(small(rng))
                 : real(rng);
  }
  return v;
}

struct gpu_case {
  pattern p;
  bool with_meta;
  meta_format format;
};

void run_case(const gpu_case& c, std::int64_t rows, std::int64_t cols, std::mt19937& rng) {
  SCOPED_TRACE(::testing::Message()
               << c.p.n << ":" << c.p.m << " meta " << c.with_meta << " "
               << dfss::meta_format_name(c.format) << " rows " << rows << " cols " << cols);
  const std::int64_t ld = cols + 3;
  const std::vector<float> dense = random_matrix(rng, static_cast<std::size_t>(rows * ld));
  const std::int64_t out_cols = (cols + c.p.m - 1) / c.p.m * c.p.n;
  const std::size_t out_size = static_cast<std::size_t>(rows * out_cols);
  const std::int64_t words_per_row = dfss::nm_metadata_words_per_row(cols, c.format);
  const std::size_t word_count = c.with_meta ? static_cast<std::size_t>(rows * words_per_row) : 0;

  std::vector<float> want_values(out_size);
  std::vector<std::int32_t> want_indices(out_size);
  std::vector<std::uint16_t> want_words(word_count);
  dfss::nm_compress(dense.data(), rows, cols, ld, c.p, want_values.data(), want_indices.data());
  if (c.with_meta) {
    dfss::nm_metadata_encode(want_indices.data(), rows, cols, c.p, c.format, want_words.data());
  }

  device_buffer<float> d_dense(dense.size());
  device_buffer<float> d_values(out_size);
  device_buffer<std::int32_t> d_indices(out_size);
  device_buffer<std::uint16_t> d_words(word_count);
  ASSERT_TRUE(cuda_ok(d_dense.status(), "cudaMalloc dense"));
  ASSERT_TRUE(cuda_ok(d_values.status(), "cudaMalloc values"));
  ASSERT_TRUE(cuda_ok(d_indices.status(), "cudaMalloc indices"));
  ASSERT_TRUE(cuda_ok(d_words.status(), "cudaMalloc words"));
  cudaStream_t stream = nullptr;
  ASSERT_TRUE(cuda_ok(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), "stream"));
  ASSERT_TRUE(cuda_ok(cudaMemcpyAsync(d_dense.get(), dense.data(), dense.size() * sizeof(float),
                                      cudaMemcpyHostToDevice, stream),
                      "copy dense"));
  // Poison the outputs so that unwritten entries cannot match by accident.
  ASSERT_TRUE(cuda_ok(cudaMemsetAsync(d_values.get(), 0x7F, out_size * sizeof(float), stream),
                      "memset values"));
  ASSERT_TRUE(
      cuda_ok(cudaMemsetAsync(d_indices.get(), 0xFF, out_size * sizeof(std::int32_t), stream),
              "memset indices"));
  if (word_count > 0) {
    ASSERT_TRUE(
        cuda_ok(cudaMemsetAsync(d_words.get(), 0xFF, word_count * 2, stream), "memset words"));
  }
  const dfss::status s =
      dfss::cuda::nm_prune_rows(d_dense.get(), rows, cols, ld, c.p, d_values.get(), d_indices.get(),
                                c.with_meta ? d_words.get() : nullptr, c.format, stream);
  ASSERT_TRUE(s.ok()) << s.message;

  std::vector<float> got_values(out_size);
  std::vector<std::int32_t> got_indices(out_size);
  std::vector<std::uint16_t> got_words(word_count);
  ASSERT_TRUE(cuda_ok(cudaMemcpyAsync(got_values.data(), d_values.get(), out_size * sizeof(float),
                                      cudaMemcpyDeviceToHost, stream),
                      "copy values"));
  ASSERT_TRUE(
      cuda_ok(cudaMemcpyAsync(got_indices.data(), d_indices.get(), out_size * sizeof(std::int32_t),
                              cudaMemcpyDeviceToHost, stream),
              "copy indices"));
  if (word_count > 0) {
    ASSERT_TRUE(cuda_ok(cudaMemcpyAsync(got_words.data(), d_words.get(), word_count * 2,
                                        cudaMemcpyDeviceToHost, stream),
                        "copy words"));
  }
  ASSERT_TRUE(cuda_ok(cudaStreamSynchronize(stream), "kernel / synchronize"));
  ASSERT_TRUE(cuda_ok(cudaStreamDestroy(stream), "stream destroy"));

  // Bit-exact comparisons, counted over every element (not stopping at the first), with the first
  // difference of each output named: printing whole vectors of a large case would flood the log.
  std::size_t bad_i = 0, bad_v = 0, bad_w = 0, first_i = 0, first_v = 0, first_w = 0;
  for (std::size_t i = 0; i < out_size; ++i) {
    if (got_indices[i] != want_indices[i] && bad_i++ == 0) first_i = i;
    if (std::memcmp(&got_values[i], &want_values[i], sizeof(float)) != 0 && bad_v++ == 0) first_v = i;
  }
  for (std::size_t i = 0; i < word_count; ++i) {
    if (got_words[i] != want_words[i] && bad_w++ == 0) first_w = i;
  }
  EXPECT_EQ(bad_i, 0u) << "indices differ, first at " << first_i << ": got " << got_indices[first_i] << ", want "
                       << want_indices[first_i];
  EXPECT_EQ(bad_v, 0u) << "values differ bitwise, first at " << first_v << ": got " << got_values[first_v]
                       << ", want " << want_values[first_v];
  EXPECT_EQ(bad_w, 0u) << "metadata words differ, first at " << first_w << ": got " << got_words[first_w]
                       << ", want " << want_words[first_w];
}

const gpu_case kCases[] = {
    {{1, 2}, true, meta_format::sm80_tf32_1of2},   {{1, 2}, true, meta_format::sm80_16bit_1of2},
    {{2, 4}, true, meta_format::sm80_16bit_2of4},  {{2, 4}, false, meta_format::sm80_16bit_2of4},
    {{3, 8}, false, meta_format::sm80_16bit_2of4}, {{5, 16}, false, meta_format::sm80_16bit_2of4},
    {{1, 1}, false, meta_format::sm80_16bit_2of4}, {{16, 16}, false, meta_format::sm80_16bit_2of4},
};

}  // namespace

TEST(NmPruneRowsGpu, MatchesHostCompressAndMetadata) {
  std::mt19937 rng(17);
  for (const gpu_case& c : kCases) {
    for (const std::int64_t rows : {1, 5, 37}) {
      for (const std::int64_t cols : {1, 3, 7, 16, 33, 70, 129, 1000}) {
        run_case(c, rows, cols, rng);  // every case runs, also after a failure
      }
    }
  }
}

TEST(NmPruneRowsGpu, GridStrideLoopCoversLargeInputs) {
  // 16500 rows x 1024 groups = 16.9M units, more than the 65535 x 256 threads of the capped grid.
  std::mt19937 rng(5);
  run_case({{1, 2}, false, meta_format::sm80_16bit_2of4}, 16500, 2048, rng);
}

TEST(NmPruneRowsGpu, RejectsBadArgumentsWithoutLaunching) {
  const dfss::status bad_pattern =
      dfss::cuda::nm_prune_rows(nullptr, 1, 8, 8, pattern{3, 2}, nullptr, nullptr, nullptr,
                                meta_format::sm80_16bit_2of4, nullptr);
  EXPECT_EQ(bad_pattern.code, dfss::status_code::invalid_argument);
  EXPECT_NE(bad_pattern.message.find("argument 'pattern'"), std::string::npos)
      << bad_pattern.message;
  std::uint16_t host_word = 0;  // any non-null pointer: validation fails before it is used
  const dfss::status mismatch =
      dfss::cuda::nm_prune_rows(nullptr, 1, 8, 8, pattern{2, 4}, nullptr, nullptr, &host_word,
                                meta_format::sm80_tf32_1of2, nullptr);
  EXPECT_EQ(mismatch.code, dfss::status_code::invalid_argument);
  EXPECT_NE(mismatch.message.find("1:2 for the metadata format"), std::string::npos)
      << mismatch.message;
  const dfss::status null_dense =
      dfss::cuda::nm_prune_rows(nullptr, 1, 8, 8, pattern{2, 4}, nullptr, nullptr, nullptr,
                                meta_format::sm80_16bit_2of4, nullptr);
  EXPECT_EQ(null_dense.code, dfss::status_code::invalid_argument);
  EXPECT_NE(null_dense.message.find("argument 'dense'"), std::string::npos) << null_dense.message;
}

int main(int argc, char** argv) {
  int devices = 0;
  const cudaError_t err = cudaGetDeviceCount(&devices);
  if (err != cudaSuccess || devices == 0) {
    std::printf("test_nm_format_gpu: skipped: no CUDA device (%s)\n",
                err != cudaSuccess ? cudaGetErrorString(err) : "cudaGetDeviceCount reported 0");
    return 77;
  }
  ::testing::InitGoogleTest(&argc, argv);
  return RUN_ALL_TESTS();
}
