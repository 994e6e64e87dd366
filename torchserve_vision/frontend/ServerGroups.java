/*
 * Takes the place of TorchServe 0.12's org.pytorch.serve.util.ServerGroups (through Agent.java):
 * the frontend's Netty event loop groups and the registry of its open channels, with the same
 * constructor, methods and behaviour, but for one thing. A graceful stop (`shutdown(true)`, what
 * SIGTERM and `torchserve --stop` run) closes every channel, waits for them to close, then ends
 * the event loops without Netty's default quiet period: TorchServe's class called
 * `shutdownGracefully()`, whose loops wait for 2 s without a new task before they end, and every
 * stop of a frontend waited those 2 s with nothing left to do, its channels already closed. The
 * tasks already queued on a loop still run before it ends, as with a quiet period.
 */
package org.pytorch.serve.util;

import io.netty.channel.Channel;
import io.netty.channel.ChannelFuture;
import io.netty.channel.EventLoopGroup;
import io.netty.channel.group.ChannelGroup;
import io.netty.channel.group.ChannelGroupFuture;
import io.netty.channel.group.DefaultChannelGroup;
import io.netty.util.concurrent.GlobalEventExecutor;
import java.util.ArrayList;
import java.util.List;
import java.util.concurrent.TimeUnit;
import org.slf4j.Logger;
import org.slf4j.LoggerFactory;

public class ServerGroups {
    private static final Logger logger = LoggerFactory.getLogger(ServerGroups.class);
    private static final long CLOSE_WAIT_S = 10;        // for the channels to close (as 0.12)
    private static final long SHUTDOWN_TIMEOUT_S = 15;  // for a loop's queued tasks (Netty's default)
    private static final long TERMINATION_WAIT_S = 60;  // for each group to end (as 0.12)

    private ChannelGroup allChannels;
    private EventLoopGroup serverGroup;
    private EventLoopGroup childGroup;
    private EventLoopGroup metricsGroup;
    private EventLoopGroup backendGroup;
    private final ConfigManager configManager;

    public ServerGroups(ConfigManager configManager) {
        this.configManager = configManager;
        init();
    }

    public final void init() {
        allChannels = new DefaultChannelGroup(GlobalEventExecutor.INSTANCE);
        serverGroup = Connector.newEventLoopGroup(2);
        childGroup = Connector.newEventLoopGroup(configManager.getNettyThreads());
        if (configManager.isMetricApiEnable()) {
            metricsGroup = Connector.newEventLoopGroup(1);
        }
        backendGroup = Connector.newEventLoopGroup(configManager.getNettyClientThreads());
    }

    public void shutdown(boolean graceful) {
        closeAllChannels(graceful);
        List<EventLoopGroup> groups = new ArrayList<>();
        groups.add(serverGroup);
        groups.add(childGroup);
        if (configManager.isMetricApiEnable()) {
            groups.add(metricsGroup);
        }
        for (EventLoopGroup group : groups) {
            group.shutdownGracefully(0, graceful ? SHUTDOWN_TIMEOUT_S : 0, TimeUnit.SECONDS);
        }
        if (!graceful) {
            return;
        }
        for (EventLoopGroup group : groups) {
            try {
                group.awaitTermination(TERMINATION_WAIT_S, TimeUnit.SECONDS);
            } catch (InterruptedException e) {
                Thread.currentThread().interrupt();
            }
        }
    }

    public EventLoopGroup getServerGroup() {
        return serverGroup;
    }

    public EventLoopGroup getChildGroup() {
        return childGroup;
    }

    public EventLoopGroup getMetricsGroup() {
        return metricsGroup;
    }

    public EventLoopGroup getBackendGroup() {
        return backendGroup;
    }

    public void registerChannel(Channel channel) {
        allChannels.add(channel);
    }

    private void closeAllChannels(boolean graceful) {
        ChannelGroupFuture closing = allChannels.close();
        if (!graceful) {
            return;
        }
        try {
            closing.await(CLOSE_WAIT_S, TimeUnit.SECONDS);
        } catch (InterruptedException e) {
            Thread.currentThread().interrupt();
        }
        if (closing.isSuccess()) {
            return;
        }
        for (ChannelFuture future : closing) {
            if (!future.isSuccess()) {
                logger.info("Unable to close channel: " + future.channel(), future.cause());
            }
        }
    }
}
