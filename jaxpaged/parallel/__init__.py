"""Many devices and hosts: the mesh and partition specs, data-parallel replicas, the multi-host leader and
follower."""
