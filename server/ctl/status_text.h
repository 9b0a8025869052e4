// fulcrumctl's text for people: a job's line in `list`, its status in
// detail (`status`, the end of `watch`), a checkpoint's line.
#ifndef FULCRUM_SERVER_CTL_STATUS_TEXT_H_
#define FULCRUM_SERVER_CTL_STATUS_TEXT_H_

#include <string>
#include <vector>

#include "fulcrum/v1/cluster.pb.h"

namespace fulcrum::ctl {

// A job state's name (RUNNING, SUCCEEDED...).
std::string State(v1::JobState s);
// Seconds as "42s", "3m07s" or "2h05m"; "-" when not positive.
std::string Duration(double seconds);
// What a job learns, for the figures shown: regression (RMSE), binary
// classification (AUC and log loss), or classes (accuracy).
enum class Task { kClasses, kBinary, kRegression };
Task TaskOf(const v1::Job& j);
// A finished job's test figures, for `watch`'s last line: "test accuracy
// 0.9781", "test AUC 0.8012, log loss 0.4512", "test RMSE 0.9123".
std::string FinalFigures(const v1::Job& j);
// One line of `fulcrumctl list`.
std::string JobLine(const v1::Job& j);
// A line per rank: where it is, on what, how fast (`status`, and under
// `watch`'s progress line).
std::vector<std::string> WorkerLines(const v1::Job& j);
// One checkpoint, indented under a job's status.
std::string CheckpointLine(const v1::CheckpointInfo& c);
// One sparse table, summed over the servers: "table emb: 1 200 000 rows,
// 80.0 MiB; admitted 5 100 000, rejected 2 300 000, evicted 3 900 000 (cap
// 3 800 000, ttl 100 000); sketch 2.0 MiB".
std::string SparseTableLine(const v1::SparseTableStats& t);
// `fulcrumctl status JOB` in text, on standard output.
void PrintStatus(const v1::Job& j);

}  // namespace fulcrum::ctl

#endif  // FULCRUM_SERVER_CTL_STATUS_TEXT_H_
