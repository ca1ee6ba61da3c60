// The standalone probes' timing: median milliseconds per launch over seven
// event-timed batches, after a warm-up.
#pragma once

#include <algorithm>
#include <vector>

#include "cuda_check.h"

inline float Median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// launch() enqueues one call on `st`; `calls` of them make one timed batch.
template <class F>
float MedianMs(F&& launch, cudaStream_t st, int warmup, int calls) {
  cudaEvent_t e0, e1;
  CK(cudaEventCreate(&e0));
  CK(cudaEventCreate(&e1));
  for (int i = 0; i < warmup; ++i) launch();
  std::vector<float> per_call;
  for (int rep = 0; rep < 7; ++rep) {
    CK(cudaEventRecord(e0, st));
    for (int i = 0; i < calls; ++i) launch();
    CK(cudaEventRecord(e1, st));
    CK(cudaEventSynchronize(e1));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, e0, e1));
    per_call.push_back(ms / calls);
  }
  CK(cudaEventDestroy(e0));
  CK(cudaEventDestroy(e1));
  return Median(per_call);
}
