"""`testbed bench faults` and `testbed soak`: one fault of testbed.lab.fault_kinds at a time while
serving, beside the bridge and the fault-free switch (faults), and sustained load for a bounded
time, with or without faults (soak, fault_soak)."""
