// The standalone probes' routing at EP1 (docs/design.md §6): every token to
// `topk` distinct experts, drawn from `rng` (both probes seed it with 5), so
// that the fused linear 1 probe and the FP8 schedule probe time the same
// groups.
#pragma once

#include <algorithm>
#include <random>
#include <vector>

// The tokens of each expert, in token order.
inline std::vector<std::vector<int>> TopkTokensByExpert(int tokens, int topk, int experts,
                                                        std::mt19937& rng) {
  std::vector<std::vector<int>> by_expert(experts);
  for (int t = 0; t < tokens; ++t) {
    std::vector<int> picked;
    while (int(picked.size()) < topk) {
      const int e = int(rng() % experts);
      if (std::find(picked.begin(), picked.end(), e) == picked.end()) picked.push_back(e);
    }
    for (int e : picked) by_expert[e].push_back(t);
  }
  return by_expert;
}
