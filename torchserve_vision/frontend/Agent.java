/*
 * The frontend agent of torchserve-vision (`-javaagent:` in the config's vmargs, written by
 * `torchserve-vision server`): when TorchServe's frontend loads a class named in REPLACED, the
 * JVM gets this project's class of the same name instead (ContinuousBatching.java: queued
 * batching; ServerGroups.java: a stop without Netty's quiet period), compiled against TorchServe
 * 0.12.0 and carried in this jar under replacement/. Nothing else changes.
 */
package torchserve_vision.frontend;

import java.io.IOException;
import java.io.InputStream;
import java.lang.instrument.ClassFileTransformer;
import java.lang.instrument.Instrumentation;
import java.security.ProtectionDomain;
import java.util.HashMap;
import java.util.Map;

public final class Agent {
    static final String[] REPLACED = {
        "org/pytorch/serve/wlm/ContinuousBatching", "org/pytorch/serve/util/ServerGroups"
    };

    private Agent() {}

    /** Where the jar carries the replacement of the class `name` (internal form, a/b/C). */
    static String replacementResource(String name) {
        return "/replacement/" + name.substring(name.lastIndexOf('/') + 1) + ".class.bin";
    }

    public static void premain(String arguments, Instrumentation instrumentation)
            throws IOException {
        final Map<String, byte[]> replacements = new HashMap<>();
        for (String name : REPLACED) {
            try (InputStream in = Agent.class.getResourceAsStream(replacementResource(name))) {
                if (in == null) {
                    throw new IOException("the agent jar lacks " + replacementResource(name));
                }
                replacements.put(name, in.readAllBytes());
            }
        }
        instrumentation.addTransformer(
                new ClassFileTransformer() {
                    @Override
                    public byte[] transform(
                            ClassLoader loader,
                            String name,
                            Class<?> redefined,
                            ProtectionDomain domain,
                            byte[] original) {
                        return replacements.get(name);
                    }
                });
    }
}
