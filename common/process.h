// Process-wide set-up done once in main(): allocator tuning and signals.
#ifndef FULCRUM_COMMON_PROCESS_H_
#define FULCRUM_COMMON_PROCESS_H_

namespace fulcrum {

// glibc's adaptive mmap threshold makes every fresh multi-MiB message buffer
// fault its pages in again (shared/ENVIRONMENT.md: 1.4-2x on big messages).
// Pins the thresholds so freed buffers are reused from the heap.
void TuneMallocForLargeMessages();

// Blocks SIGINT/SIGTERM in all threads (call before starting any) and
// returns a function that waits for one of them; returns the signal number.
int WaitForTerminationSignal();
void BlockTerminationSignals();

}  // namespace fulcrum

#endif  // FULCRUM_COMMON_PROCESS_H_
