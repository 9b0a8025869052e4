// Metrics of binary classifiers: the area under the ROC curve and the log
// loss, as click-through-rate models are judged.
#ifndef FULCRUM_COMMON_BINARY_METRICS_H_
#define FULCRUM_COMMON_BINARY_METRICS_H_

#include <vector>

namespace fulcrum {

// The probability that a random positive scores above a random negative
// (ties count half): the Mann-Whitney statistic over `scores` and 0/1
// `labels`. 0.5 when either class is absent.
double Auc(const std::vector<double>& scores, const std::vector<float>& labels);

// The mean of -log(p) for positives and -log(1 - p) for negatives, with p
// clamped to [1e-15, 1 - 1e-15].
double LogLoss(const std::vector<double>& probabilities, const std::vector<float>& labels);

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_BINARY_METRICS_H_
