"""High availability: leadership through etcd (lease, epoch, takeover), the standby's probe of
the leader, and the cluster view members and front-ends are shown."""
