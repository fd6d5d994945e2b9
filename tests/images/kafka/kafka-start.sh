#!/bin/sh
# Format KRaft storage (first start only) and run a single-node Kafka broker in the foreground.
#
# Clients connect to the address in KAFKA_ADVERTISED_LISTENERS, so it must be reachable from where the
# clients run: the tests publish the container port on the same host port and advertise localhost:<port>.
#
# Env:
#   KAFKA_PORT                   client listener port inside the container (default 9092)
#   KAFKA_ADVERTISED_LISTENERS   what clients are told to connect to (default PLAINTEXT://localhost:$KAFKA_PORT)
#   KAFKA_HEAP_OPTS              JVM heap flags (default -Xms256m -Xmx768m)
set -eu

port="${KAFKA_PORT:-9092}"
advertised="${KAFKA_ADVERTISED_LISTENERS:-PLAINTEXT://localhost:$port}"
controller_port=29093
[ "$controller_port" = "$port" ] && controller_port=29094
data=/var/lib/kafka/data
# Configuration goes to a fresh directory of its own: the image may run under any uid (the chart's trial
# Kafka runs as 1000, not as the image's user), which cannot write to the image's home directory.
conf_dir="$(mktemp -d)"
conf="$conf_dir/server.properties"

# Same settings as local/kafka_config.py's server_properties(): one node, every internal topic with
# replication factor 1 (transactions and consumer groups hang otherwise), no auto-created topics.
cat >"$conf" <<PROPS
process.roles=broker,controller
node.id=1
controller.quorum.bootstrap.servers=localhost:$controller_port
listeners=PLAINTEXT://0.0.0.0:$port,CONTROLLER://localhost:$controller_port
advertised.listeners=$advertised,CONTROLLER://localhost:$controller_port
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
controller.listener.names=CONTROLLER
inter.broker.listener.name=PLAINTEXT
log.dirs=$data
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
offsets.topic.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
PROPS

cat >"$conf_dir/log4j2.properties" <<'LOG4J'
status = warn
appender.out.type = Console
appender.out.name = out
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = info
rootLogger.appenderRef.out.ref = out
logger.request.name = kafka.request.logger
logger.request.level = warn
logger.state.name = state.change.logger
logger.state.level = warn
LOG4J

# shellcheck disable=SC2086 # KAFKA_HEAP_OPTS is a list of flags
set -- java ${KAFKA_HEAP_OPTS:--Xms256m -Xmx768m} -XX:+UseG1GC -XX:MaxGCPauseMillis=20 \
  -XX:+ExitOnOutOfMemoryError -Djava.awt.headless=true \
  -Dlog4j2.configurationFile=$conf_dir/log4j2.properties -cp '/opt/kafka/libs/*'

if [ ! -f "$data/meta.properties" ]; then
  # A KRaft cluster id: 16 random bytes, url-safe base64 without padding, not starting with '-'.
  while :; do
    cluster_id="$(head -c 16 /dev/urandom | base64 | tr '+/' '-_' | tr -d '=')"
    case "$cluster_id" in -*) ;; *) break ;; esac
  done
  "$@" kafka.tools.StorageTool format --standalone -t "$cluster_id" -c "$conf" >/dev/null
fi

exec "$@" kafka.Kafka "$conf"
